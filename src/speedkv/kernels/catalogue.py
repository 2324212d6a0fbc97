"""Every native kernel speedkv has, in one table: adding a kernel is a source in csrc/ and a
row here (then the call that uses it, with torch's kernel as the fallback).

A row says where the kernel's source is, which operators its library registers in
`torch.ops.speedkv`, which kinds of work it does (`kernels.tuning` measures each kind against
torch's kernels and sets aside every kernel that does a kind torch's do faster), which other
kernels' operators it calls, and where the engine calls it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    """One native kernel: csrc/<name>.cpp, built into its own library."""

    name: str
    operators: tuple[str, ...]  # what its library may register in torch.ops.speedkv
    # the kinds of work it does: a kernel named after its kind is that kind's candidate; one
    # doing several kinds is used only while every one of them stays native
    kinds: tuple[str, ...]
    dispatch: str  # where its operators are called, beside torch's fallback
    requires: tuple[str, ...] = ()  # other kernels' operators it calls: used only with them

    @property
    def source(self) -> str:
        return f"{self.name}.cpp"


CATALOGUE = (
    Kernel("decode_attention", ("decode_attention", "decode_attention_lanes"),
           kinds=("decode_attention",), dispatch="kernels.attention.batch_decode_attention"),
    Kernel("decode_linear", ("pack_linear_weight", "packed_linear"),
           kinds=("decode_linear",), dispatch="kernels.linear.apply_linear, prepacked"),
    # runs a whole decode layer: its small operations, products and attention
    Kernel("decode_layer", ("decode_layer",),
           kinds=("decode_attention", "layer_ops", "decode_linear"),
           dispatch="hf.layer_work.decode_layer",
           requires=("rms_norm", "add_rms_norm", "silu_mul", "rotary_split", "packed_linear",
                     "decode_attention")),
    Kernel("layer_ops", ("rms_norm", "add_rms_norm", "silu_mul", "rotary_split"),
           kinds=("layer_ops",), dispatch="hf.layer_work.before_attention, after_attention"),
    Kernel("prefill_attention", ("causal_attention", "prefill_attention_unit"),
           kinds=("prefill_attention",), dispatch="kernels.attention.prefill_attention"),
    # decode's larger batches on the decode linear layers' packed copy (AMX tiles)
    Kernel("tile_linear", ("tile_linear",),
           kinds=("decode_linear",), dispatch="kernels.linear.apply_linear"),
)  # fmt: skip

BY_NAME = {kernel.name: kernel for kernel in CATALOGUE}
# the kinds of work the tuner chooses a kernel for: those a kernel is named after
KINDS = tuple(kernel.name for kernel in CATALOGUE if kernel.kinds == (kernel.name,))
# what a decode layer in one native call needs built and chosen (besides the tile kernel for
# batches)
ONE_CALL_OPERATORS = (*BY_NAME["decode_layer"].operators, *BY_NAME["decode_layer"].requires)


def operators_of(kind: str) -> tuple[str, ...]:
    """The native operators a kind of work uses: those of every kernel that does it."""
    return tuple(op for kernel in CATALOGUE if kind in kernel.kinds for op in kernel.operators)
