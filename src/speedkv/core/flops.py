"""Analytic FLOPs: the paper's layer-token cost model plus the attention term.

A token computed in one layer costs 2 FLOPs per weight of that layer (its projections and MLP);
one query attending to one key costs 4 * heads * head_dim (scores and weighted values). The LM
head runs once per produced token. Norms, rotary and softmax are left out: they are small and
the same for every method.
"""

from __future__ import annotations

from speedkv.hf.backbone import ModelShape


def layer_weights(shape: ModelShape) -> int:
    attn = shape.hidden_size * shape.head_dim * (2 * shape.num_heads + 2 * shape.num_kv_heads)
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    return attn + mlp


def head_flops(shape: ModelShape) -> int:
    return 2 * shape.hidden_size * shape.vocab_size


def pair_flops(shape: ModelShape) -> int:
    return 4 * shape.num_heads * shape.head_dim


def prefill_flops(shape: ModelShape, rows: list[int], pairs: list[int]) -> int:
    """rows[l] tokens computed and pairs[l] query-key pairs attended in layer l."""
    weights = 2 * layer_weights(shape)
    return sum(weights * r + pair_flops(shape) * p for r, p in zip(rows, pairs)) + head_flops(shape)


def decode_flops(shape: ModelShape, reads: int, steps: int) -> int:
    """`steps` decode tokens through every layer that together read `reads` cached entries."""
    per_token = 2 * layer_weights(shape) * shape.num_layers + head_flops(shape)
    return steps * per_token + pair_flops(shape) * reads
