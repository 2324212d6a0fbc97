"""What a leaderboard reads from kvpress's peer answers: the attention numerics their header
names. benchmarks/kvpress_peer.py's driver reads headers through this too; its kvpress half,
which runs in kvpress's own environment, never imports speedkv."""

from __future__ import annotations

# how attention computes, as headers name it: torch's bfloat16 SDPA, or float32's from the
# bfloat16 cache (kvpress_peer.py's ATTENTION_IN_BFLOAT16 and ATTENTION_IN_FLOAT32)
ATTENTION_IN_BFLOAT16 = "bfloat16"
ATTENTION_IN_FLOAT32 = "float32"


def recorded_attention(header: dict) -> str:
    """The attention a header's answers were made with: bfloat16 before headers said."""
    return header.get("attention", ATTENTION_IN_BFLOAT16)
