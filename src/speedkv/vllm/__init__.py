"""speedkv's vLLM plugin: SPEED on the engine people deploy.

- `args.py`: a speedkv method spec -> vLLM engine arguments (`engine_args`), with the checks,
- `plugin.py`: the `vllm.general_plugins` entry point (registers the SPEED architectures),
- `support.py`: which vLLM configurations SPEED runs, and one sentence for each it refuses,
- `models.py`: SPEED variants of vLLM's Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (the layer
  loop that skips rows),
- `stacks.py`: the two halves of that loop, each compiled by vLLM on its own,
- `attention.py`: the upper layers' backend (compact metadata and K/V slots),
- `metadata.py`: the rule for every field of vLLM's common attention metadata,
- `compact.py`: which rows of a step are full depth and where their K/V live (pure torch),
- `batch.py`: the prompt lengths and blocks the runner knows and the metadata lacks,
- `kv_spec.py`: the upper layers' own KV cache spec and manager,
- `settings.py`: SPEED's settings as vLLM carries them, and how vLLM groups the layers,
- `guards.py`: requests SPEED cannot answer (prompt logprobs) get a clear error,
- `offline.py`: speedkv's generate and bench records from `vllm.LLM`,
- `timing.py`: how a request's TTFT and TPOT are read from vLLM (bench and the benchmarks),
- `serve.py`: the `vllm serve` command line that runs a method.

`args.py`, `compact.py`, `metadata.py`, `settings.py`, `support.py` and `timing.py` import
without vLLM installed; the others need it.
"""

from speedkv.vllm.args import engine_args, require_vllm

__all__ = ["engine_args", "require_vllm"]
