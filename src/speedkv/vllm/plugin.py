"""The entry point vLLM calls in each of its processes (`vllm.general_plugins`).

It registers the SPEED architectures under new names: stock Llama and Qwen2 stay as they are, and
a user picks SPEED per model through `hf_overrides` (see `engine_args`); it makes vLLM check a
SPEED engine's configuration when it is built (`support.py`), refuse requests SPEED cannot
answer (`guards.py`), and hand prefix-cache hits from the scheduler to the workers
(`reuse.py`). Idempotent: vLLM may call it more than once per process.
"""

from __future__ import annotations

from speedkv.vllm.settings import ARCHITECTURES


def register() -> None:
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for arch in ARCHITECTURES.values():
        if arch not in known:
            # a "module:Class" string: vLLM imports it only where the model is built
            ModelRegistry.register_model(arch, f"speedkv.vllm.models:{arch}")
    from speedkv.vllm.guards import install_request_guard
    from speedkv.vllm.reuse import install_scheduler_hook
    from speedkv.vllm.support import install_config_hook

    install_config_hook(list(ARCHITECTURES.values()))  # refuse what SPEED cannot run, at start
    install_request_guard()  # refuse what SPEED cannot answer (prompt logprobs)
    install_scheduler_hook()  # hand each request's prefix-cache hit to the workers
