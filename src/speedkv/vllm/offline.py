"""speedkv's `generate` and `bench` on vLLM's offline engine (`vllm.LLM`).

One engine per model, method and dtype; requests go in as token ids (the prompt speedkv's own
engine would see), and each comes back as the record `speedkv generate --json` prints.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedkv.core.sampling import SamplingParams
from speedkv.hf.backbone import ModelShape
from speedkv.methods.speed import SpeedRule
from speedkv.vllm.args import engine_args, model_shape, require_vllm
from speedkv.vllm.compact import RequestLayout, anchor_slots
from speedkv.vllm.settings import SpeedSettings
from speedkv.vllm.timing import request_times


def cpu_engine_defaults(kv_gib: int) -> None:
    """What vLLM's CPU build is given where the user set nothing:

    - a KV pool of `kv_gib` GiB (VLLM_CPU_KVCACHE_SPACE): left alone it sizes the pool from a
      share of all RAM and takes minutes to start on a small machine;
    - where there is no CUDA, no AOT compile step (VLLM_USE_AOT_COMPILE=0): the AOT artifacts
      vLLM-CPU 0.32 saves never load again ("'function' object has no attribute
      'finalize_loading'", vllm-project/vllm#45447), so every start compiled the model anew.
      Without that step vLLM saves no cache of its own here, and a later start reuses torch
      inductor's cache of the compiled kernels (`speedkv generate --backend vllm`'s second
      start took 106 s instead of 221 s, docs/vllm.md).
    """
    import torch

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def cpu_thread_binding(ranks: int) -> None:
    """On vLLM's CPU build, bind each of `ranks` workers (tensor x pipeline parallel) to a core
    of this process, round-robin, unless the user set VLLM_CPU_OMP_THREADS_BIND: vLLM's own
    choice binds by NUMA node and refuses more workers than nodes."""
    if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        binding = "|".join(str(cores[r % len(cores)]) for r in range(ranks))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding


def shut_down(llm: Any) -> None:
    """Shut a `vllm.LLM` down now. Left to the garbage collector, an in-process engine tears
    down vLLM's process-wide distributed state whenever it happens to be collected, which may
    be under the next engine."""
    llm.llm_engine.engine_core.shutdown()


def engine_kwargs(vllm_args: list[str]) -> dict[str, Any]:
    """vLLM engine options given as its own command-line flags (`--vllm-arg`), as keyword
    arguments of `vllm.LLM`: the ones that differ from vLLM's defaults."""
    if not vllm_args:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="--vllm-arg"))
    given = vars(parser.parse_args(["--model", "-", *vllm_args]))
    default = vars(parser.parse_args(["--model", "-"]))
    return {k: v for k, v in given.items() if k != "model" and v != default.get(k)}


def quiet_vllm_logs(level: str = "WARNING") -> None:
    """vLLM's log lines on stderr and at `level`, unless the user set them: stdout carries
    speedkv's own output (--json). Call before vLLM is imported."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", level)


@dataclass
class VllmEngine:
    """A vLLM engine running one method on one model directory."""

    llm: Any
    directory: Path
    method: str
    shape: ModelShape
    kv_bytes_per_token_layer: int
    block_size: int
    speed: SpeedSettings | None  # None: stock vLLM
    stages: list[tuple[int, int]]  # the layers [start, end) of each pipeline stage

    @classmethod
    def open(cls, directory: str | Path, method: str, dtype: str = "auto",
             **llm_args: Any) -> VllmEngine:  # fmt: skip
        require_vllm()
        import torch
        from vllm import LLM
        from vllm.distributed.utils import get_pp_indices

        directory = Path(directory)
        shape = model_shape(directory)
        args = {**engine_args(method, directory), **llm_args}
        if not torch.cuda.is_available():
            ranks = args.get("tensor_parallel_size", 1) * args.get("pipeline_parallel_size", 1)
            cpu_thread_binding(ranks)
        llm = LLM(model=str(directory), dtype=dtype, disable_log_stats=False, **args)
        config = llm.llm_engine.vllm_config
        kv_dtype = config.model_config.dtype
        pp = config.parallel_config.pipeline_parallel_size
        return cls(
            llm=llm,
            directory=directory,
            method=method,
            shape=shape,
            kv_bytes_per_token_layer=shape.kv_bytes_per_token_layer(
                kv_dtype if isinstance(kv_dtype, torch.dtype) else torch.float32
            ),
            block_size=config.cache_config.block_size,
            # as the engine settled them (pipeline stages may keep stock blocks: support.py)
            speed=SpeedSettings.from_hf_config(config.model_config.hf_config)
            if SpeedSettings.from_overrides(args.get("hf_overrides"))
            else None,
            stages=[get_pp_indices(shape.num_layers, rank, pp) for rank in range(pp)],
        )

    def close(self) -> None:
        shut_down(self.llm)

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def dtype_name(self) -> str:
        return str(self.llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[dict]:
        """One record per prompt, in order, with the fields of `speedkv generate --json`."""
        from vllm import SamplingParams as VllmSampling

        params = VllmSampling(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            ignore_eos=sampling.ignore_eos,
            min_tokens=sampling.min_new_tokens,
            repetition_penalty=sampling.repetition_penalty,
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        return [self._record(o) for o in outputs]

    def _record(self, output) -> dict:
        completion = output.outputs[0]
        new = len(completion.token_ids)
        times = request_times(output)  # as every benchmark of vLLM times it
        ttft = times.ttft_s if times else math.nan
        tpot = (times.tpot_s or 0.0) if times else 0.0
        prompt = len(output.prompt_token_ids)
        return {
            "backend": "vllm",
            "method": self.method,
            "prompt_ids": list(output.prompt_token_ids),
            "output_ids": list(completion.token_ids),
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "kv_bytes": self.block_bytes(prompt + 1, prompt),
            "kv_bytes_final": self.block_bytes(prompt + new, prompt),
            "kv_allocated_bytes": self.block_bytes(prompt + new, prompt),
            "layer_lengths": self.layer_lengths(prompt),
            "reused_tokens": int(getattr(output, "num_cached_tokens", 0) or 0),
        }

    def layer_lengths(self, prompt: int) -> list[int]:
        """K/V rows each layer holds for the next token when the first new token is produced:
        the rows the rule gives it (`SpeedRule.rows_held`), a windowed layer's inside its
        window, as speedkv's own engine reports them."""
        layers, speed, window = self.shape.num_layers, self.speed, self.shape.largest_window
        if speed is None:
            rule = SpeedRule.full(layers)
        else:
            rule = SpeedRule(speed.lcut, speed.anchors, speed.deep, window=window)
        return [rule.rows_held(layer, prompt, self.shape.window(layer)) for layer in range(layers)]

    def block_bytes(self, tokens: int, prompt: int) -> int:
        """Bytes of the KV blocks vLLM's pool holds for a request of `tokens` tokens, over
        every pipeline stage. Each KV cache group (`SpeedSettings.group_layers`) holds a block
        per `block_size` tokens, less the blocks a windowed group has freed behind its window;
        an upper group with SPEED's own blocks holds one per `block_size` full-depth rows
        (`RequestLayout.rows`, a windowed one's anchors padded to a block). A block costs each
        stage as many layer slots as its largest group there (padding included).
        Tensor-parallel ranks each hold their share of the heads; the sum is the same."""
        layers, windows, size = self.shape.num_layers, self.shape.windows, self.block_size
        speed = self.speed or SpeedSettings(layers, 0, 0, compact_kv=False)
        layout = RequestLayout.of(prompt, speed.anchors, speed.deep,
                                  window=self.shape.largest_window)  # fmt: skip
        kinds = speed.kv_kinds(layers, windows)
        blocks = 0
        for group in speed.group_layers(layers, windows):
            upper_own, windowed = kinds[group[0]]
            if upper_own:
                slots = anchor_slots(speed.anchors, size) if windowed else 0
                blocks += math.ceil(layout.rows(tokens, slots) / size)
            else:
                # vLLM's window manager frees the blocks wholly behind the window
                behind = max(tokens - windows[group[0]], 0) // size if windowed else 0
                blocks += math.ceil(tokens / size) - behind
        slots = sum(speed.stage_slots(layers, self.stages, windows))
        return blocks * size * slots * self.kv_bytes_per_token_layer
