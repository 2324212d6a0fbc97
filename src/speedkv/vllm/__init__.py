"""speedkv's vLLM plugin: SPEED on the engine people deploy.

- `args.py`: a speedkv method spec -> vLLM engine arguments (`engine_args`), with the checks,
- `plugin.py`: the `vllm.general_plugins` entry point (registers the SPEED architectures),
- `models.py`: SPEED variants of vLLM's Llama and Qwen2 (the layer loop that skips rows),
- `attention.py`: the upper layers' backend (compact metadata and K/V slots),
- `compact.py`: which rows of a step are full depth and where their K/V live (pure torch),
- `batch.py`: the prompt lengths the runner knows and the metadata lacks,
- `guards.py`: requests SPEED cannot answer (prompt logprobs) get a clear error,
- `offline.py`: speedkv's generate and bench records from `vllm.LLM`,
- `serve.py`: the `vllm serve` command line that runs a method.

Only `args.py` and `compact.py` import without vLLM installed.
"""

from speedkv.vllm.args import engine_args, require_vllm

__all__ = ["engine_args", "require_vllm"]
