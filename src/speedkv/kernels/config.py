"""The engine's kernel configuration: which native operators it uses and how it splits the
products between kernels, decided once from the measured choice (`kernels.tuning`) and handed
to the code that runs them (the backbone, and through it every linear product), never kept in
a module's globals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALL_ROWS = 1 << 30

# speedkv's native CPU operations (kernels/native.py's NativeKernels), or None: torch's only
NativeOps = Any


@dataclass(frozen=True)
class KernelConfig:
    """What the engine runs its products and small operations on. The default is torch's
    kernels for everything that is not already laid out for speedkv's (a packed copy always
    runs on the kernel that packed it)."""

    ops: NativeOps = None
    # decode batches of up to this many rows use the prepacked weights, larger ones the plain
    # weights through oneDNN (or the tile kernel: `tiles_above`)
    native_linear_rows: int = ALL_ROWS
    # products on speedkv's packed bfloat16 copy with more rows than this run on the AMX tile
    # kernel (kernels/csrc/tile_linear.cpp) rather than the one-row kernel; None: never
    tiles_above: int | None = None
    # bfloat16 CPU products of MEASURED_UPCAST_FROM rows or more run in float32, rounded once
    float32_products: bool = False

    def tiles_for_rows(self, rows: int) -> bool:
        """Whether products of `rows` rows on a packed copy the tile kernel takes go to it."""
        return self.tiles_above is not None and rows > self.tiles_above


TORCH_KERNELS = KernelConfig()
