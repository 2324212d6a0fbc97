"""What the upper layers' builder needs of a step that vLLM's attention metadata lacks: each
request's prompt length, its prefix-cache hit (`reuse.py`), and the blocks each KV cache group
holds for it, on the host.

vLLM's V1 model runner knows the lengths and blocks (`input_batch.num_prompt_tokens_cpu_tensor`,
the original length, also when a preempted request is recomputed; `input_batch.block_table`,
whose host copy is the one the device table is made from, in the KV manager's block unit), and
learns the hits from the scheduler's output. Thin wrappers around the runner keep and publish
them while it builds a step's metadata:

- around `_update_states`: each scheduler output's hits, kept per request,
- around `_build_attention_metadata`: the facts of a real step,
- around `_dummy_run`: the step is a dummy (warm-up, profiling), shapes only.

A builder that runs outside both (Model Runner V2, a drafter, a future caller) gets no facts and
raises: SPEED never guesses a prompt length. Model Runner V2 is refused at engine start
(`support.py`); this is the second line.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from speedkv.errors import Unsupported
from speedkv.vllm.compact import Layout
from speedkv.vllm.reuse import hits_of, keep_hits

NO_STEP = (
    "SPEED cannot tell the prompt lengths of this step: its attention metadata was built "
    "outside vLLM's V1 model runner step (Model Runner V2, a drafter or another caller), and "
    "the plugin never guesses them"
)
_HOOKED = "_speedkv_hooked"


@dataclass(frozen=True)
class GroupBlocks:
    """One KV cache group's blocks during a step."""

    layer_names: frozenset[str]
    table: np.ndarray  # [requests, width] each request's block ids (host copy)
    blocks_per_row: np.ndarray  # how many of them the KV manager holds, per request
    block_size: int  # tokens per block, in the KV manager's unit


@dataclass(frozen=True)
class StepFacts:
    prompt_lens: torch.Tensor  # [requests] each request's prompt length (CPU)
    groups: tuple[GroupBlocks, ...]
    # [requests] tokens each reused from the prefix cache (0: none), and the compact rows
    # those tokens hold; None: no request reused any
    hit_tokens: torch.Tensor | None = None
    hit_rows: torch.Tensor | None = None

    def layout(self, num_reqs: int, anchors: int, deep: int, window: int | None = None) -> Layout:
        """Where the step's first `num_reqs` requests put their full-depth rows (`window`: the
        model's widest sliding window, if it has one)."""
        prompts = self.prompt_lens[:num_reqs]
        if self.hit_tokens is None or self.hit_rows is None:
            return Layout.of(prompts, anchors, deep, window=window)
        return Layout.of(prompts, anchors, deep, self.hit_tokens[:num_reqs],
                         self.hit_rows[:num_reqs], window)  # fmt: skip

    def blocks_of(self, layer_name: str) -> GroupBlocks:
        for group in self.groups:
            if layer_name in group.layer_names:
                return group
        raise Unsupported(f"SPEED found no KV cache group holding layer {layer_name}")


_DUMMY = "dummy"
_current: StepFacts | str | None = None


def current_step() -> StepFacts | None:
    """The facts of the step being built; None in a dummy step (warm-up, profiling)."""
    if _current is None:
        raise Unsupported(NO_STEP)
    return None if _current == _DUMMY else _current  # type: ignore[return-value]


@contextmanager
def publishing(facts: StepFacts | str) -> Iterator[None]:
    global _current
    previous, _current = _current, facts
    try:
        yield
    finally:
        _current = previous


def runner_facts(runner) -> StepFacts:
    """The facts of the step a V1 model runner is building."""
    tables = runner.input_batch.block_table.block_tables
    groups = tuple(
        GroupBlocks(
            frozenset(group.layer_names),
            table.get_numpy_array(),
            table.num_blocks_per_row,
            table.block_size,
        )
        for group, table in zip(runner.kv_cache_config.kv_cache_groups, tables)
    )
    prompt_lens = runner.input_batch.num_prompt_tokens_cpu_tensor
    hits = torch.zeros(2, prompt_lens.numel(), dtype=torch.long)
    found = hits_of(runner, list(runner.input_batch.req_ids))
    if found:
        hits[:, : len(found)] = torch.tensor(found, dtype=torch.long).T
    return StepFacts(prompt_lens, groups, hits[0], hits[1])


def install_runner_hooks() -> None:
    """Wrap the V1 (GPU/CPU) model runner's metadata build, dummy runs and state update, once
    per process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = GPUModelRunner._build_attention_metadata
    if getattr(build, _HOOKED, False):
        return
    dummy_run = GPUModelRunner._dummy_run
    update_states = GPUModelRunner._update_states

    @functools.wraps(build)
    def build_with_facts(self, *args, **kwargs):
        if _current == _DUMMY:  # a dummy run building metadata (force_attention)
            return build(self, *args, **kwargs)
        with publishing(runner_facts(self)):
            return build(self, *args, **kwargs)

    @functools.wraps(dummy_run)
    def dummy_run_marked(self, *args, **kwargs):
        with publishing(_DUMMY):
            return dummy_run(self, *args, **kwargs)

    @functools.wraps(update_states)
    def update_states_with_hits(self, scheduler_output, *args, **kwargs):
        keep_hits(self, scheduler_output)
        return update_states(self, scheduler_output, *args, **kwargs)

    for wrapper in (build_with_facts, dummy_run_marked, update_states_with_hits):
        setattr(wrapper, _HOOKED, True)
    GPUModelRunner._build_attention_metadata = build_with_facts
    GPUModelRunner._dummy_run = dummy_run_marked
    GPUModelRunner._update_states = update_states_with_hits
