"""A lock between processes that a dead process cannot hold, for work done once per machine
(a kernel build, a model conversion) that several processes may start at the same time:
filelock's `flock`, which the system drops when its holder exits, however it exits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout


@contextlib.contextmanager
def exclusive(path: Path, timeout: float) -> Iterator[bool]:
    """Hold an exclusive lock on `path` (True), or give up after `timeout` seconds (False)."""
    lock = FileLock(path, timeout=timeout)
    try:
        lock.acquire(poll_interval=0.5)
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()
