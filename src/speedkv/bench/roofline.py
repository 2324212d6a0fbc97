"""What this machine could do at best: measured memory bandwidth and matmul rate, and the
bounds they put on a decode step (bytes that must be read) and on a prefill (FLOPs that must
be done). `speedkv bench` measures both in the same run and prints every cell as "x times
the limit", so a figure says how far it is from the hardware, not only from another method.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from speedkv.hf.loading import dtype_name
from speedkv.kernels import linear
from speedkv.kernels.config import TORCH_KERNELS
from speedkv.kernels.tuning import engine_config, engine_kernels


@dataclass(frozen=True)
class MachineLimits:
    bandwidth_bytes_s: float  # sustained read bandwidth of a large tensor
    matmul_flops_s: float  # a large square matmul in the model's dtype
    dtype: str
    device: str
    # weight bytes per second of matrix-vector products in the model's dtype (or int8): what
    # the kernels a decode step must use reach, below the raw bandwidth on a CPU
    gemv_bytes_s: float | None = None

    def decode_bound_s(self, weight_bytes: int, kv_read_bytes: float) -> float:
        """One decode step reads every weight once, through matrix-vector products, and every
        visible cached K/V once."""
        weights_rate = self.gemv_bytes_s or self.bandwidth_bytes_s
        return weight_bytes / weights_rate + kv_read_bytes / self.bandwidth_bytes_s

    def prefill_bound_s(self, flops: float) -> float:
        return flops / self.matmul_flops_s

    def describe(self) -> str:
        return (
            f"{self.bandwidth_bytes_s / 1e9:.1f} GB/s read, "
            f"{self.matmul_flops_s / 1e12:.3f} TFLOP/s {self.dtype} matmul, "
            f"{(self.gemv_bytes_s or 0) / 1e9:.1f} GB/s of weights in matrix-vector products "
            f"on {self.device}"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocation, kernel selection
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of reading a tensor far larger than any cache (a float32 sum: the
    reduction is cheap, so the read is the cost)."""
    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    seconds = _best_time(lambda: data.sum(), device, repeats)
    return data.numel() * 4 / seconds


def measure_matmul(
    device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5
) -> float:
    """FLOP/s of a square matmul, the best case for dense prefill work in `dtype`, on the
    path a prefill's products take (`linear.apply_linear` on the engine's kernels: in float32
    where the CPU's oneDNN takes no bfloat16, or where float32 was measured faster)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = (torch.randn(size, size, device=device).to(dtype), None)
    kernels = engine_config() if device.type == "cpu" else TORCH_KERNELS
    seconds = _best_time(lambda: linear.apply_linear(a, b, kernels), device, repeats)
    return 2 * size**3 / seconds


def measure_gemv(
    device: torch.device,
    dtype: torch.dtype,
    int8: bool = False,
    prepacked: bool = False,
    megabytes: int = 256,
) -> float:
    """Weight bytes per second of one-row matrix products over weights far larger than any
    cache, in decoder-layer shapes: the rate a batch-1 decode step's weight reads can reach
    with the kernels it runs (torch's int8 weight kernel for int8 weights on a CPU; for
    prepacked ones speedkv's native kernel where the engine uses it, else oneDNN's)."""
    rows, cols = 2048, 1024
    element = 1 if int8 else torch.empty((), dtype=dtype).element_size()
    count = max(1, megabytes * 2**20 // (rows * cols * element))
    x = torch.randn(1, cols, device=device).to(dtype)
    if int8:  # as linear.apply_linear takes int8 layers: (rows, scale, bias)
        scale = torch.rand(rows, device=device).to(dtype) / 127
        mats = [
            (torch.randint(-127, 128, (rows, cols), dtype=torch.int8, device=device), scale, None)
            for _ in range(count)
        ]
    else:
        mats = [(torch.randn(rows, cols, device=device).to(dtype), None) for _ in range(count)]
        ops = engine_kernels() if device.type == "cpu" else None
        if prepacked and linear.can_prepack(mats[0], ops):
            mats = [linear.prepacked(w, ops) for w in mats]

    def run() -> None:
        for w in mats:
            linear.apply_linear(x, w)

    return count * rows * cols * element / _best_time(run, device, repeats=5)


def measure_limits(
    device: torch.device, dtype: torch.dtype, int8_weights: bool = False, prepacked: bool = False
) -> MachineLimits:
    return MachineLimits(
        bandwidth_bytes_s=measure_bandwidth(device),
        matmul_flops_s=measure_matmul(device, dtype),
        dtype=dtype_name(dtype),
        device=str(device),
        gemv_bytes_s=measure_gemv(device, dtype, int8_weights, prepacked),
    )
