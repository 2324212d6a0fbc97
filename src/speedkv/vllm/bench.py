"""`speedkv bench --backend vllm`: the same sweep as `speedkv bench`, on vLLM.

Every method gets its own vLLM engine, and all of them stay alive, so each repeat runs the
methods back to back in rotated order and every ratio is against `full` (stock vLLM) from the
same repeat, as in speedkv's own bench. FLOPs are not reported: they are speedkv's own engine's
count. KV bytes are the blocks vLLM's pool holds (`VllmEngine.block_bytes`).

Like is compared with like: prefix caching is off for every engine, stock vLLM included (SPEED
runs without it), and each repeat measures a prompt of its own, so no engine answers a repeat
from a cache of the one before.
"""

from __future__ import annotations

from pathlib import Path

import torch

from speedkv.bench.memory import peak_rss_bytes, reset_peak_rss
from speedkv.bench.report import HF
from speedkv.bench.roofline import MachineLimits, measure_limits
from speedkv.bench.runner import Bench, BenchConfig, check_config
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.hf.loading import load_tokenizer
from speedkv.vllm.args import model_shape
from speedkv.vllm.offline import VllmEngine


class VllmBench(Bench):
    prompt_per_repeat = True
    notes = (
        "vLLM: prefix caching off for every method, stock vLLM included; each repeat measures "
        "a prompt of its own (the same one for every method within the repeat).",
    )

    def __init__(self, directory: Path, config: BenchConfig, out: Path,
                 engine_options: dict | None = None):  # fmt: skip
        self.config, self.out = config, out
        self.shape = model_shape(directory)
        check_config(config, self.shape.max_positions)
        methods = ["full", *(str(m) for m in config.methods)]
        if HF in methods:
            raise UserError("'hf' is transformers' generate; --backend vllm runs full and speed")
        self.methods = list(dict.fromkeys(methods))
        self._tokenizer = load_tokenizer(directory)
        self._limits: MachineLimits | None = None
        self.decode_mode = "vllm"
        self.engines = {
            m: VllmEngine.open(
                directory,
                m,
                dtype=config.dtype,
                **{**(engine_options or {}), "enable_prefix_caching": False},
            )
            for m in self.methods
        }

    def run(self, resume: bool, progress: bool = True) -> dict:
        try:
            return super().run(resume, progress)
        finally:
            for engine in self.engines.values():
                engine.close()

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def dtype_name(self) -> str:
        return self.engines["full"].dtype_name

    def decode_weight_bytes(self) -> int:
        """The weights a decode step reads, from the model's shape: every layer's projections
        and norms, the final norm and the LM head."""
        s = self.shape
        attention = s.hidden_size * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)
        layer = attention + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size
        total = s.num_layers * layer + s.hidden_size + s.vocab_size * s.hidden_size
        return total * getattr(torch, self.dtype_name).itemsize

    def limits(self) -> MachineLimits:
        if self._limits is None:
            dtype = getattr(torch, self.dtype_name)
            self._limits = measure_limits(torch.device("cpu"), dtype, False, False)
        return self._limits

    def measure(self, method: str, ids: list[int], new_tokens: int) -> dict:
        reset_peak_rss()
        sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        record = self.engines[method].generate([ids], sampling)[0]
        row = {k: record[k] for k in ("ttft_s", "tpot_s", "kv_bytes", "kv_bytes_final")}
        row.update(flops_prefill=None, flops_decode=None, output_ids=record["output_ids"])
        row["peak_rss_bytes"] = peak_rss_bytes()
        return row
