"""The entry point vLLM calls in each of its processes (`vllm.general_plugins`).

It registers the SPEED architectures under new names (`settings.ARCHITECTURES`: Llama, Mistral,
Qwen2, Qwen3, Gemma 3): the stock ones stay as they are, and a user picks SPEED per model through
`hf_overrides` (see `engine_args`); it makes vLLM check a SPEED engine's configuration when it
is built (`support.py`), refuse requests SPEED cannot answer (`guards.py`), and hand
prefix-cache hits from the scheduler to the workers (`reuse.py`). Idempotent: vLLM may call it
more than once per process.

On a vLLM the plugin does not support (`versions.py`) it patches nothing: the SPEED names
resolve to classes that refuse, and the config hook refuses with one sentence naming the
supported versions. vLLM itself, without SPEED, runs as if the plugin were not there (vLLM
does not catch a plugin's errors, so registering must not fail).
"""

from __future__ import annotations

from speedkv.log import log
from speedkv.vllm.settings import ARCHITECTURES

_announced = False
# why SPEED is refused in this process, where it is (the refusing classes raise it)
refused_because: str | None = None


def register() -> None:
    from vllm import ModelRegistry

    from speedkv.vllm.versions import mismatch, refusal

    refused = refusal()
    if refused is not None:
        _register_refusing(ModelRegistry, refused)
        return
    try:
        from speedkv.vllm.guards import install_request_guard
        from speedkv.vllm.reuse import install_scheduler_hook
        from speedkv.vllm.support import install_config_hook

        install_config_hook(list(ARCHITECTURES.values()))  # refuse what SPEED cannot run
        install_request_guard()  # refuse what SPEED cannot answer (prompt logprobs)
        install_scheduler_hook()  # hand each request's prefix-cache hit to the workers
    except Exception as err:
        found = mismatch()
        if found is None:  # the supported vLLM: a bug, with its traceback
            raise
        # an unsupported vLLM run anyway (SPEEDKV_VLLM_UNSUPPORTED_OK=1) whose internals moved
        _register_refusing(ModelRegistry, f"speedkv's vLLM plugin could not hook into the "
                           f"{found} installed here ({type(err).__name__}: {err})")  # fmt: skip
        return
    known = set(ModelRegistry.get_supported_archs())
    for arch in ARCHITECTURES.values():
        if arch not in known:
            # a "module:Class" string: vLLM imports it only where the model is built
            ModelRegistry.register_model(arch, f"speedkv.vllm.models:{arch}")


def _register_refusing(registry, sentence: str) -> None:
    """Where SPEED cannot run: the SPEED names refuse with `sentence`, nothing else of vLLM is
    patched, and one line says so once per process."""
    global _announced, refused_because
    refused_because = sentence
    if not _announced:
        _announced = True
        log(f"SPEED is not available: {sentence}", source="vllm")
    try:
        known = set(registry.get_supported_archs())
        for arch in ARCHITECTURES.values():
            if arch not in known:
                registry.register_model(arch, f"speedkv.vllm.refused:{arch}")
        from speedkv.vllm.support import install_config_hook

        install_config_hook(list(ARCHITECTURES.values()), refused=sentence)
    except Exception as err:  # a vLLM whose registry or config hooks moved
        log(f"SPEED's refusal could not be registered on this vLLM ({err!r})", source="vllm")
