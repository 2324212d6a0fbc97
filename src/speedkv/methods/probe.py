"""Probes for methods that look at the prompt before prefilling it (GemFilter, SpecPrefill):
run a model, or the first layers of one, and record queries and keys along the way."""

from __future__ import annotations

import torch

from speedkv.core.engine import Engine
from speedkv.core.policy import Policy


class QueryRecorder(Policy):
    """Full attention that keeps, per layer, the last prompt row's query, the prompt keys and
    every decode-phase query. Internal: not registered as a method."""

    name = "probe"

    def __init__(self, shape, layers: set[int]):
        super().__init__(Policy.Config(), shape)
        self.layers = layers
        self.prompt_queries: dict[int, torch.Tensor] = {}  # layer -> [Hq, 1, D]
        self.prompt_keys: dict[int, torch.Tensor] = {}  # layer -> [Hkv, n, D]
        self.decode_queries: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}

    def fresh(self) -> QueryRecorder:
        return QueryRecorder(self.shape, self.layers)

    def query_window(self, layer: int) -> int:
        return 1 if layer in self.layers else 0

    def observe(self, layer, view) -> None:
        if layer in self.layers:
            self.prompt_queries[layer] = view.queries()[0][:, -1:].clone()
            self.prompt_keys[layer] = view.kv.keys().clone()

    def after_decode(self, layer, q, kv) -> None:
        if layer in self.layers:
            self.decode_queries[layer].append(q.clone())


def record(
    engine: Engine,
    ids: torch.Tensor,
    layers: set[int],
    look_ahead: int = 1,
    eos_ids: set[int] | None = None,
) -> tuple[QueryRecorder, list[int]]:
    """Prefill `ids` through `engine`, then greedily decode `look_ahead - 1` more tokens
    (stopping at EOS), recording queries and prompt keys of `layers`.

    Returns the recorder and the look-ahead tokens produced (EOS excluded).
    """
    recorder = QueryRecorder(engine.shape, layers)
    done = engine.prefill_ids(ids, recorder, spare=look_ahead)
    tokens, logits = [], done.logits
    for step in range(look_ahead - 1):
        token = int(logits.argmax())
        if eos_ids and token in eos_ids:
            break
        tokens.append(token)
        logits = engine.decode_step([done.cache], [recorder], [token], [done.next_position + step])[
            0
        ]
    return recorder, tokens


def step_queries(recorder: QueryRecorder, layer: int) -> list[torch.Tensor]:
    """The recorded queries of `layer`: the last prompt row's, then one per look-ahead step."""
    return [recorder.prompt_queries[layer], *recorder.decode_queries[layer]]
