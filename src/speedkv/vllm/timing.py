"""How speedkv times vLLM, in one place: `speedkv bench --backend vllm` and the benchmark
scripts that run stock vLLM beside speedkv (benchmarks/vllm_peer.py, vllm_prefix_cache.py,
against_vllm.py through vllm_peer.py) all read a request's TTFT and TPOT here.

- **TTFT** is vLLM's own `first_token_latency`: from the request's arrival at the front end to
  its first token, the whole prefill included.
- **TPOT** is the engine core's time from the first generated token to the last over the tokens
  between them: decode steps alone.

Both come from one request (`RequestOutput.metrics`, kept when the engine runs with
`disable_log_stats=False`), so neither assumes that two runs of the same prompt prefill in the
same time, which a shared CPU does not grant. Where vLLM kept no metrics, `request_times` says
so (None), and a caller falls back to the wall time of `timed_generate`.

A timed engine can also stay loaded and answer one job at a time over a pipe (`serve_jobs`,
`READY`/`RESULT`), for a caller that interleaves vLLM's runs with its own engine's.

Nothing here imports vLLM; it reads the outputs vLLM returns.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# how the lines a served peer answers with on stdout start
READY, RESULT = "@@ready ", "@@result "


@dataclass(frozen=True)
class RequestTimes:
    """One finished request's times, from vLLM's own timestamps."""

    ttft_s: float
    tpot_s: float | None  # None: fewer than two new tokens, no decode step to time


def request_times(output: Any) -> RequestTimes | None:
    """TTFT and TPOT of one finished `vllm.RequestOutput` (see the module's docstring), or None
    where vLLM kept no metrics for it (an engine started with `disable_log_stats=True`)."""
    stats = getattr(output, "metrics", None)
    ttft = getattr(stats, "first_token_latency", 0) if stats is not None else 0
    if not ttft or ttft <= 0:
        return None
    new = getattr(stats, "num_generation_tokens", 0) or len(output.outputs[0].token_ids)
    tpot = (stats.last_token_ts - stats.first_token_ts) / (new - 1) if new > 1 else None
    return RequestTimes(float(ttft), tpot)


def timed_generate(llm: Any, prompts: Sequence[Sequence[int]], params: Any) -> tuple[float, list]:
    """`llm.generate` on token-id prompts (never re-tokenized): its wall seconds, and its
    outputs in order."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=False)  # fmt: skip
    return time.perf_counter() - start, outputs


def serve_jobs(measure: Callable[[dict], dict], about: dict) -> None:
    """Answer jobs one at a time, the engine kept loaded: `READY <json about the engine>` once,
    then for each JSON job a line on stdin one line `RESULT <json>` on stdout, until stdin
    closes. A caller interleaves these with its own engine's runs, so slow spells of a shared
    CPU fall on both engines alike."""
    print(READY + json.dumps(about), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(RESULT + json.dumps(measure(json.loads(line))), flush=True)
