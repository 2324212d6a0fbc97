"""A request's prefix-cache hit, handed from vLLM's scheduler to its workers.

Under SPEED a reused prefix holds as many upper-layer rows as its history made full depth, so
the worker must know, for each request that starts from the cache, how many tokens it reused
and how many compact rows they hold (`compact.Layout`). The scheduler's KV manager for the upper
layers knows both (`kv_spec.SpeedUpperManager.hits`); vLLM's scheduler output does not carry
them. So:

- the scheduler's `schedule` is wrapped to attach `{request id: (tokens, rows)}` for every
  request it admits or resumes this step (0, 0 for one without a hit) to its output,
- the worker's `_update_states` is wrapped to keep them per request until it finishes.

The output object travels to the workers as it is (in this process, or pickled to worker
processes), so the extra attribute goes with it.
"""

from __future__ import annotations

import functools

FIELD = "speedkv_hits"
_HOOKED = "_speedkv_reuse_hooked"
_KEPT = "_speedkv_hits"


def step_hits(scheduler, output) -> dict[str, tuple[int, int]]:
    """(tokens, rows) of each request the scheduler admitted or resumed in `output`."""
    from speedkv.vllm.kv_spec import SpeedUpperManager

    coordinator = scheduler.kv_cache_manager.coordinator
    upper = [m for m in coordinator.single_type_managers if isinstance(m, SpeedUpperManager)]
    if not upper:
        return {}
    started = [r.req_id for r in output.scheduled_new_reqs]
    started += list(output.scheduled_cached_reqs.resumed_req_ids)
    return {req: upper[0].hits.get(req, (0, 0)) for req in started}


def install_scheduler_hook() -> None:
    """Wrap vLLM's scheduler once per process."""
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule
    if getattr(schedule, _HOOKED, False):
        return

    @functools.wraps(schedule)
    def schedule_with_hits(self, *args, **kwargs):
        output = schedule(self, *args, **kwargs)
        setattr(output, FIELD, step_hits(self, output))
        return output

    setattr(schedule_with_hits, _HOOKED, True)
    Scheduler.schedule = schedule_with_hits


def keep_hits(runner, scheduler_output) -> None:
    """Update a worker's hits from one scheduler output."""
    kept = runner.__dict__.setdefault(_KEPT, {})
    for req in scheduler_output.finished_req_ids:
        kept.pop(req, None)
    for req, (tokens, rows) in getattr(scheduler_output, FIELD, {}).items():
        if tokens:
            kept[req] = (tokens, rows)
        else:
            kept.pop(req, None)


def hits_of(runner, req_ids: list[str | None]) -> list[tuple[int, int]]:
    """(tokens, rows) of each request slot of the runner's batch."""
    kept = runner.__dict__.get(_KEPT, {})
    return [kept.get(req, (0, 0)) if req is not None else (0, 0) for req in req_ids]
