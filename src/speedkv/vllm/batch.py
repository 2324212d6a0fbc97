"""The one fact SPEED needs that vLLM's attention metadata lacks: each request's prompt length.

The model runner knows it (`input_batch.num_prompt_tokens_cpu_tensor`, the original length, also
when a preempted request is recomputed). A thin wrapper around the runner's metadata build
publishes that tensor for the builders it calls, in the same order as the step's requests.
"""

from __future__ import annotations

import functools

import torch

_current: torch.Tensor | None = None  # per-row prompt lengths of the step being built
_HOOKED = "_speedkv_prompt_lengths"


def prompt_lengths(num_reqs: int) -> torch.Tensor:
    """Prompt length of each of the step's first `num_reqs` requests."""
    if _current is None:
        # No step is being built (a warm-up or profile run): no prompt, every position is deep.
        return torch.zeros(num_reqs, dtype=torch.int64)
    return _current[:num_reqs]


def install_runner_hook() -> None:
    """Wrap the GPU/CPU model runner's metadata build once per process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = GPUModelRunner._build_attention_metadata
    if getattr(build, _HOOKED, False):
        return

    @functools.wraps(build)
    def build_with_prompt_lengths(self, *args, **kwargs):
        global _current
        _current = self.input_batch.num_prompt_tokens_cpu_tensor
        try:
            return build(self, *args, **kwargs)
        finally:
            _current = None

    setattr(build_with_prompt_lengths, _HOOKED, True)
    GPUModelRunner._build_attention_metadata = build_with_prompt_lengths
