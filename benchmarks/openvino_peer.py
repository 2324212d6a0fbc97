"""OpenVINO GenAI as a benchmark peer (openvino-genai in its own environment, `make openvino-venv`).

Two jobs, both run by that environment's interpreter:

  measure (imports only openvino, openvino_genai and numpy):
    .venv-openvino/bin/python benchmarks/openvino_peer.py --model .venv-openvino/smollm2-135m-ov \
        --requests jobs.json --out out.json --threads 2 --repeats 2 [--kv-fraction 0.733]

  export (optimum-intel; make does it with the HF folder speedkv converted the embedded GGUF to):
    .venv-openvino/bin/python benchmarks/openvino_peer.py --export HF_DIR \
        --model .venv-openvino/smollm2-135m-ov

The export is optimum-intel's: a stateful IR (input_ids, attention_mask, position_ids, beam_idx)
with the tokenizer and detokenizer IRs LLMPipeline loads, its weights in bfloat16 -- speedkv's
own rounding of the float32 checkpoint, never int8 or int4 (the export checks the IR).

The jobs file is benchmarks/peers.py's: a list of {"name", "prompts": [[ids]], "max_new_tokens"}.
Every job runs through `openvino_genai.LLMPipeline.generate` on token ids (`TokenizedInputs`,
never text), greedy, EOS ignored, on the CPU plugin with INFERENCE_NUM_THREADS = --threads and
bfloat16 compute and KV cache (INFERENCE_PRECISION_HINT, KV_CACHE_PRECISION; the plugin's own
KV default is u8). The pipeline is given a SchedulerConfig, so it runs GenAI's continuous
batching (paged attention) backend, LLMPipeline's default on x86 CPUs, with that default's
unlimited max_num_batched_tokens (a whole prompt, or a whole batch of them, in one step) but
prefix caching off, which the default turns on: every request starts from an empty cache.
The plugin's settings are read back from a model compiled with the same properties and stored
with the results; a run whose threads or precisions differ from those asked for stops.

Batch 1: TTFT is the wall time from the `generate` call to the first token's arrival at a
token streamer (`StreamerBase.write`, GenAI calls it once per generated token); TPOT is the
mean time between the first and the last token's arrival, (t_last - t_first) / (N - 1).
GenAI's own PerfMetrics TTFT and TPOT are stored beside them as a cross-check.
Batches: one `generate` of all B prompts as a [B, L] TokenizedInputs (left-padded, with its
attention mask, if lengths differ), which the continuous-batching backend schedules as B
requests; wall_1_s is its wall time with max_new_tokens = 1 (the prefills), wall_s with N.

--kv-fraction F adds GenAI's own KV-cache eviction (SchedulerConfig.cache_eviction_config,
NORM_SUM scores, rotation off: GenAI's defaults) with a per-sequence budget of F x the prompt's
length in 32-token blocks (the CPU's paged-cache block), keeping the first block and the last
64 tokens. A budget belongs to the pipeline, so each prompt length gets a pipeline of its own.
Eviction runs after the prefill step (the whole prompt is prefilled at full attention) and frees
blocks from then on, so it saves decode reads and memory, not prefill work.

Each pipeline is warmed up once (a short generate); every figure is the median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 32  # tokens per KV block of the CPU plugin's paged cache
START, RECENT = 32, 64  # tokens eviction never touches: the first block, the latest 64


def plugin_properties(args) -> dict:
    """CPU plugin settings for every pipeline: threads, bf16 compute and a bf16 KV cache."""
    return {
        "INFERENCE_NUM_THREADS": args.threads,
        "INFERENCE_PRECISION_HINT": "bf16",
        # the plugin's default on x86 is a u8 KV cache; the other engines keep bfloat16
        "KV_CACHE_PRECISION": "bf16",
    }


def plugin_report(ov, model: str, properties: dict) -> dict:
    """What the CPU plugin does with `properties`, read back from a model compiled with them."""
    core = ov.Core()
    compiled = core.compile_model(f"{model}/openvino_model.xml", "CPU", properties)
    keys = [
        "INFERENCE_NUM_THREADS",
        "INFERENCE_PRECISION_HINT",
        "KV_CACHE_PRECISION",
        "KEY_CACHE_PRECISION",
        "VALUE_CACHE_PRECISION",
        "NUM_STREAMS",
        "ENABLE_CPU_PINNING",
        "PERFORMANCE_HINT",
    ]
    report = {key: str(compiled.get_property(key)) for key in keys}
    report["cpu"] = str(core.get_property("CPU", "FULL_DEVICE_NAME"))
    report["cpu_capabilities"] = list(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    report["cpu_default_precision"] = str(core.get_property("CPU", "INFERENCE_PRECISION_HINT"))
    asked = {"INFERENCE_NUM_THREADS": str(properties["INFERENCE_NUM_THREADS"])}
    asked |= {k: "<Type: 'bfloat16'>" for k in keys[1:5]}
    wrong = {k: report[k] for k, v in asked.items() if report[k] != v}
    if wrong:
        sys.exit(f"the CPU plugin did not take the settings asked for: {wrong}")
    return report


def weight_types(ov, model: str) -> dict[str, int]:
    """Elements of the IR's constants by element type (the weights' precision, as stored)."""
    counts: dict[str, int] = {}
    for op in ov.Core().read_model(f"{model}/openvino_model.xml").get_ops():
        if op.get_type_name() == "Constant":
            kind = op.get_element_type().get_type_name()
            counts[kind] = counts.get(kind, 0) + math.prod(op.shape)
    return counts


def eviction_budget(length: int, fraction: float) -> int:
    """A per-sequence KV budget of `fraction` of `length` tokens, in whole blocks."""
    blocks = max(round(fraction * length / BLOCK), (START + RECENT) // BLOCK + 1)
    return blocks * BLOCK


def pipeline(genai, model: str, properties: dict, budget: int | None):
    """An LLMPipeline on the continuous-batching backend; with `budget`, evicting to it."""
    scheduler = genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False  # every request from an empty cache
    # as LLMPipeline's own default scheduler: no cap on the tokens of one step
    scheduler.max_num_batched_tokens = 2**64 - 1
    if budget is not None:
        scheduler.use_cache_eviction = True
        scheduler.cache_eviction_config = genai.CacheEvictionConfig(
            START, RECENT, budget, genai.AggregationMode.NORM_SUM
        )
    return genai.LLMPipeline(model, "CPU", scheduler_config=scheduler, **properties)


def measure(args) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    class Stamps(genai.StreamerBase):
        """Arrival time of each generated token."""

        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def write(self, token) -> genai.StreamingStatus:
            now = time.perf_counter()
            self.times += [now] * (len(token) if isinstance(token, list) else 1)
            return genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    def inputs(prompts: list[list[int]]):
        """The prompts as one [B, L] batch, left-padded where lengths differ."""
        width = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
        return genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(mask))

    def config(new_tokens: int):
        settings = genai.GenerationConfig()
        settings.max_new_tokens = new_tokens
        settings.ignore_eos = True
        settings.do_sample = False
        return settings

    def run_one(pipe, ids: list[int], new_tokens: int) -> dict:
        stamps = Stamps()
        start = time.perf_counter()
        result = pipe.generate(inputs([ids]), config(new_tokens), stamps)
        out = [int(t) for t in result.tokens[0]]
        if len(out) != new_tokens or len(stamps.times) != new_tokens:
            sys.exit(
                f"asked for {new_tokens} tokens, got {len(out)} ({len(stamps.times)} streamed)"
            )
        metrics = result.perf_metrics
        return {
            "ttft_s": stamps.times[0] - start,
            "tpot_s": (stamps.times[-1] - stamps.times[0]) / max(1, new_tokens - 1),
            "ttft_perf_metrics_s": metrics.get_ttft().mean / 1000,
            "tpot_perf_metrics_s": metrics.get_tpot().mean / 1000,
            "output_ids": [out],
        }

    def run_batch(pipe, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
        start = time.perf_counter()
        result = pipe.generate(inputs(prompts), config(new_tokens))
        wall = time.perf_counter() - start
        return wall, [[int(t) for t in out] for out in result.tokens]

    def measure_job(pipe, job: dict) -> dict:
        prompts, new_tokens = job["prompts"], job["max_new_tokens"]
        samples = []
        for _ in range(args.repeats):
            if len(prompts) == 1:
                sample = run_one(pipe, prompts[0], new_tokens)
                text = f"TTFT {sample['ttft_s']:.2f} s, TPOT {1000 * sample['tpot_s']:.1f} ms"
            else:
                wall_1, _ = run_batch(pipe, prompts, 1)
                wall, out = run_batch(pipe, prompts, new_tokens)
                sample = {"wall_1_s": wall_1, "wall_s": wall, "output_ids": out}
                text = f"1 token {wall_1:.2f} s, {new_tokens} tokens {wall:.2f} s"
            samples.append(sample)
            print(f"[openvino_peer] {job['name']}: {text}", file=sys.stderr, flush=True)
        medians = {
            key: statistics.median(s[key] for s in samples)
            for key in samples[0]
            if key != "output_ids"
        }
        first = samples[0]["output_ids"]
        return {"name": job["name"], **medians, "output_ids": first, "samples": samples}

    def warm_up(pipe, jobs: list[dict]) -> None:
        prompts = [p[:64] for job in jobs for p in job["prompts"]][:8]
        pipe.generate(inputs(prompts), config(4))

    jobs = json.loads(Path(args.requests).read_text())
    properties = plugin_properties(args)
    report = plugin_report(ov, args.model, properties)
    # a KV budget belongs to a pipeline: one pipeline per budget (per prompt length when
    # evicting, else one for every job), its jobs in order
    lengths = {job["name"]: max(len(p) for p in job["prompts"]) for job in jobs}
    budgets = {n: eviction_budget(n, args.kv_fraction) for n in lengths.values()}

    def budget(job: dict) -> int | None:
        return budgets[lengths[job["name"]]] if args.kv_fraction else None

    results = []
    for kept in dict.fromkeys(budget(job) for job in jobs):
        group = [job for job in jobs if budget(job) == kept]
        pipe = pipeline(genai, args.model, properties, kept)
        warm_up(pipe, group)
        extra = {"kv_budget_tokens": kept} if kept is not None else {}
        results += [measure_job(pipe, job) | extra for job in group]
        del pipe
    order = [job["name"] for job in jobs]
    results.sort(key=lambda r: order.index(r["name"]))
    result = {
        "engine": "openvino-genai",
        "version": genai.__version__,
        "openvino_version": ov.__version__,
        "model": args.model,
        "weights": weight_types(ov, args.model),
        "properties": {k: str(v) for k, v in properties.items()},
        "plugin": report,
        "scheduler": {
            "backend": "continuous batching (LLMPipeline with a SchedulerConfig)",
            "enable_prefix_caching": False,
            "max_num_batched_tokens": "unlimited",
            "cache_eviction": {
                "kv_fraction": args.kv_fraction,
                "start_size": START,
                "recent_size": RECENT,
                "max_cache_size_by_length": budgets,
                "aggregation_mode": "NORM_SUM",
                "apply_rotation": False,
            }
            if args.kv_fraction
            else None,
        },
        "jobs": results,
    }
    Path(args.out).write_text(json.dumps(result))


def export(args) -> None:
    """The IR LLMPipeline loads, from the HF folder `args.export`, weights kept in bfloat16."""
    import openvino as ov

    source, target = Path(args.export), Path(args.model)
    # written beside the target and moved there once checked: make sees no half-made IR
    partial = target.with_name(f"{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        # speedkv's folder has float32 weights and no architectures; declaring bfloat16 makes
        # optimum-intel load the model in bfloat16 and store those weights as they are (its
        # --weight-format knows only fp16 or fp32; models under 1B parameters get no int8)
        for item in source.iterdir():
            if item.name != "config.json":
                (Path(tmp) / item.name).symlink_to(item.resolve())
        config = json.loads((source / "config.json").read_text())
        config.setdefault("architectures", ["LlamaForCausalLM"])
        config["dtype"] = "bfloat16"
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        cli = Path(sys.executable).parent / "optimum-cli"
        command = [str(cli), "export", "openvino", "--model", tmp, "--task"]
        subprocess.run([*command, "text-generation-with-past", str(partial)], check=True)
    # an int8 or int4 export would hold most of its elements in u8, i8, u4 or i4 constants
    counts = weight_types(ov, str(partial))
    if counts.get("bf16", 0) < 0.99 * sum(counts.values()):
        sys.exit(f"{partial} does not hold bfloat16 weights: {counts}")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    print(f"[openvino_peer] {target}: constants by type {counts}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the OpenVINO IR folder (to run or write)")
    parser.add_argument("--requests", help="jobs file (see benchmarks/peers.py)")
    parser.add_argument("--out", help="where to write the results (JSON)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--kv-fraction",
        type=float,
        default=0.0,
        help="with GenAI's KV-cache eviction, to this fraction of each prompt (0: none)",
    )
    parser.add_argument("--export", help="an HF model folder: write --model from it")
    args = parser.parse_args()
    if args.export:
        export(args)
    elif args.requests and args.out:
        measure(args)
    else:
        parser.error("give --requests and --out to measure, or --export to write the IR")


if __name__ == "__main__":
    main()
