"""Reusing a prompt's cache: a cached prefix, and a bounded store of them.

A cache built under a reusable method (full attention, SPEED) does not depend on what
follows the prompt, so a later prompt that starts with the same tokens can start from it:
only its new tokens are prefilled, attending to the cached entries, and a token keeps the
depth it was first computed at. Extending never writes a cached buffer; it copies the entries
it needs (copy-on-extend), so any number of requests can share one prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from speedkv.core.cache import KVCache


@dataclass
class CachedPrefix:
    """A prompt's K/V kept for reuse: the tokens it covers (positions 0..n-1), the method
    that built it, and, for a chat prompt, the conversation those tokens encode."""

    ids: list[int]
    method: str  # canonical spec; prompts extending it run the same method
    cache: KVCache  # never written again
    messages: list[dict] | None = None  # None: raw text
    ttft_s: float = 0.0  # how long building it took
    meta: dict = field(default_factory=dict)  # where it came from (a file, a request), for reports

    def __len__(self) -> int:
        return len(self.ids)

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def allocated_bytes(self) -> int:
        return self.cache.allocated_bytes()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def extends(longer: CachedPrefix, shorter: CachedPrefix) -> bool:
    """Whether `longer` covers everything `shorter` does (same method, a prefix of its ids)."""
    n = len(shorter)
    return longer.method == shorter.method and len(longer) >= n and longer.ids[:n] == shorter.ids


class PrefixCache:
    """Cached prefixes looked up by token prefix, evicted least recently used once they hold
    more than `max_bytes` of buffers. A lookup reuses at most all but the prompt's last token
    (its logits must be computed) and nothing shorter than `min_tokens`."""

    def __init__(self, max_bytes: int, min_tokens: int = 16):
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()
        self._next_key = 0
        self.hits = self.misses = self.tokens_reused = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def bytes(self) -> int:
        """Buffer bytes the cached prefixes hold."""
        return sum(entry.allocated_bytes() for entry in self._entries.values())

    def lookup(
        self,
        ids: Sequence[int],
        method: str,
        fits: Callable[[CachedPrefix, int], bool] | None = None,
    ) -> tuple[CachedPrefix, int] | None:
        """The cached prefix sharing the most leading tokens with `ids` under `method`, and how
        many of them to reuse; None when nothing long enough is cached. `fits(entry, reuse)`
        may rule an entry out (one that dropped entries a window at `reuse` would see)."""
        best, best_key, shared = None, None, 0
        for key, entry in self._entries.items():
            if entry.method == method:
                n = common_prefix(entry.ids, ids)
                if n > shared and (fits is None or fits(entry, min(n, len(ids) - 1))):
                    best, best_key, shared = entry, key, n
        reuse = min(shared, len(ids) - 1)
        if best is None or reuse < self.min_tokens:
            self.misses += 1
            return None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += reuse
        return best, reuse

    def insert(self, entry: CachedPrefix) -> None:
        """Keep `entry`; entries it extends go (it serves every lookup they would), and the
        least recently used go while the store is over its bound. One larger than the bound
        is not kept, and the entries it extends stay."""
        if entry.allocated_bytes() > self.max_bytes:
            return
        for key, old in list(self._entries.items()):
            if extends(old, entry):  # already covered: only freshen it
                self._entries.move_to_end(key)
                return
            if extends(entry, old):
                del self._entries[key]
        self._entries[self._next_key] = entry
        self._next_key += 1
        while self.bytes() > self.max_bytes:
            self._entries.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
