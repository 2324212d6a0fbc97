"""Continuous batching: one thread owns the engine and runs every request's sequences.

Each turn of the loop drops cancelled sequences, admits waiting ones while the batch has room
(prefill + first token through `Batch.add`), then runs one decode step for every running
sequence (`Batch.step`). Tokens go back to the HTTP handlers through their asyncio queues
(`loop.call_soon_threadsafe`), so torch never runs on the event loop.

A long prompt's prefill blocks the decode steps of the others while it runs: sequences already
decoding see one long step whenever a newcomer is admitted.

The engine's prefix cache (automatic prefix caching) is touched only by this thread: `Batch.add`
looks a prompt up and leaves its snapshot there, a finishing sequence leaves its whole cache,
and the metrics copy the store's state after either, before the client hears of it. HTTP
threads read only those metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from speedkv.core.engine import Batch, Engine, Request, TokenEvent
from speedkv.errors import UserError
from speedkv.server.metrics import ServerMetrics

log = logging.getLogger("speedkv.server")

_job_ids = itertools.count(1)


@dataclass
class Failure:
    """A sequence that could not run: `status` 400 for a user mistake found at prefill."""

    message: str
    status: int = 500


class Job:
    """One HTTP request: its sequences (one per choice) and the queue its handler reads.

    Items are `(choice index, TokenEvent | Failure)`."""

    def __init__(self, requests: list[Request], loop: asyncio.AbstractEventLoop, arrival: float):
        self.id = next(_job_ids)
        self.requests = requests
        self.loop = loop
        self.arrival = arrival  # time.perf_counter() when the HTTP request arrived
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def deliver(self, index: int, item: TokenEvent | Failure) -> None:
        """Hand an item to the handler; called from the scheduler thread."""
        # RuntimeError: the event loop has closed, nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, (index, item))


class QueueFull(Exception):
    """The waiting queue has no room for this request's sequences."""


class ShuttingDown(Exception):
    """The scheduler has stopped accepting work."""


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int, max_queue: int, metrics: ServerMetrics):
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self._batch = Batch(engine)
        self._running: dict[tuple[int, int], Job] = {}  # only the scheduler thread touches it
        self._waiting: deque[tuple[Job, int]] = deque()
        self._cancelled: set[int] = set()
        self._stopping = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="speedkv-scheduler", daemon=True)

    # -- called from the event loop ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences."""
        with self._wake:
            return len(self._running), len(self._waiting)

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._stopping:
                raise ShuttingDown
            if len(self._waiting) + len(job.requests) > self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull
            self._waiting.extend((job, index) for index in range(len(job.requests)))
            self.metrics.waiting.set(len(self._waiting))
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Drop every sequence of `job`, waiting or running; its caches are freed before the
        next decode step."""
        job.cancelled = True
        with self._wake:
            self._cancelled.add(job.id)
            self._wake.notify()

    # -- the scheduler thread ---------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._waiting or self._cancelled or self._running):
                    self._wake.wait()
                if self._stopping:
                    break
                cancelled, self._cancelled = self._cancelled, set()
                kept = [(job, i) for job, i in self._waiting if job.id not in cancelled]
                self.metrics.finished.labels("cancelled").inc(len(self._waiting) - len(kept))
                self._waiting = deque(kept)
                self._drop_running(cancelled)
                admit: deque[tuple[Job, int]] = deque()
                while self._waiting and len(self._running) + len(admit) < self.max_batch:
                    admit.append(self._waiting.popleft())
            try:
                while admit:
                    job, index = admit.popleft()
                    if job.cancelled:  # cancelled while earlier prompts were prefilled
                        self.metrics.finished.labels("cancelled").inc()
                    else:
                        self._prefill(job, index)
                if self._running:
                    self._step()
            except Exception:  # a bug, not a request's fault: fail what runs, keep serving
                log.exception("scheduler error")
                message = "the server hit an internal error; see its log"
                self._fail_running(message)
                for job, index in admit:
                    job.deliver(index, Failure(message))
            self._publish()
        self._fail_running("the server is shutting down", 503)
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
        for job, index in waiting:
            job.deliver(index, Failure("the server is shutting down", 503))
        self._publish()

    def _prefill(self, job: Job, index: int) -> None:
        key = (job.id, index)
        request = job.requests[index]
        try:
            events = self._batch.add(key, request, since=job.arrival)
        except UserError as err:  # a method that cannot run this prompt
            self.metrics.finished.labels("error").inc()
            job.deliver(index, Failure(str(err), 400))
            return
        except Exception as err:
            log.exception("prefill failed")
            self.metrics.finished.labels("error").inc()
            job.deliver(index, Failure(f"prefill failed: {type(err).__name__}"))
            return
        finally:
            self._publish_prefix_cache()  # looked up, and the prompt left there
        self.metrics.prompt_tokens.inc(len(request.ids))
        self.metrics.ttft.observe(time.perf_counter() - job.arrival)
        with self._wake:
            self._running[key] = job
        self._dispatch(events)

    def _step(self) -> None:
        size = len(self._batch)
        events = self._batch.step()
        self.metrics.batch_size.observe(size)
        self._dispatch(events)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            job = self._running[event.key]
            self.metrics.generated.inc()
            done = event.finished
            if done is not None:
                self._publish_prefix_cache()  # its cache went to the prefix cache
                self.metrics.finished.labels(done.finish_reason).inc()
                if len(done.output_ids) > 1:
                    self.metrics.tpot.observe(done.tpot_s)
                with self._wake:
                    del self._running[event.key]
            job.deliver(event.key[1], event)

    def _drop_running(self, job_ids: set[int]) -> None:
        """Cancel running sequences of these jobs (caller holds the lock)."""
        for key in [key for key in self._running if key[0] in job_ids]:
            self._batch.cancel(key)
            del self._running[key]
            self.metrics.finished.labels("cancelled").inc()

    def _fail_running(self, message: str, status: int = 500) -> None:
        with self._wake:
            running, self._running = self._running, {}
        for (job_id, index), job in running.items():
            self._batch.cancel((job_id, index))
            self.metrics.finished.labels("error").inc()
            job.deliver(index, Failure(message, status))

    def _publish_prefix_cache(self) -> None:
        if self.engine.prefix_cache is not None:
            self.metrics.publish_prefix_cache(self.engine.prefix_cache)

    def _publish(self) -> None:
        self.metrics.kv_bytes.set(self._batch.kv_bytes())
        self.metrics.running.set(len(self._batch))
        with self._wake:
            self.metrics.waiting.set(len(self._waiting))
