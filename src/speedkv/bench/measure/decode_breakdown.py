"""Where a decode step's milliseconds go: weight matmuls, attention, and the rest.

    .venv/bin/speedkv measure decode-breakdown --lengths 2048,8192 --steps 24

For each prompt length, mode (plain weights, prepacked weights) and method, prefills one
prompt, then times decode steps with nothing else running (the step's wall time, median) and
profiles as many again with torch.profiler, which splits the time of the ops: products with
the weights (mm, oneDNN's linear, the int8 kernel, speedkv's linear), attention (everything
inside the engine's decode-attention function, which the profiled steps wrap in a named
range, or the native attention kernel where a whole layer runs as one native call), and
everything else (norms, rotary, residual adds, cache writes, Python) as the step's
wall time minus those two. Prints a markdown table. Works on any checkout of speedkv on the
path, so this file run by path measures an older engine (`PYTHONPATH=OLD/src python
src/speedkv/bench/measure/decode_breakdown.py`; the prepacked mode is skipped where the engine
has none).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

from torch.profiler import ProfilerActivity, profile, record_function

import speedkv.core.engine as engine_module
from speedkv import Engine, load_model
from speedkv.prompts.builders import chat_document

WEIGHT_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::_weight_int8pack_mm",
    "mkldnn::_linear_pointwise",
    "speedkv::packed_linear",  # the native decode linear kernel (kernels/csrc/decode_linear.cpp)
    "speedkv::tile_linear",  # the AMX kernel for decode batches (kernels/csrc/tile_linear.cpp)
}
# the native attention kernel as a whole decode layer calls it (kernels/csrc/decode_layer.cpp),
# with no Python function around it to name
NATIVE_ATTENTION = "speedkv::decode_attention"
ATTENTION_RANGE = "decode attention"
# what the engine calls for a step's attention: this checkout's name, then older checkouts'
ATTENTION_FUNCTIONS = ("batch_decode_attention", "decode_attention")


@contextmanager
def attention_as_a_named_range():
    """Within it, the engine's decode attention runs inside a profiler range of its own, so
    its whole time is counted whatever ops it is made of in this checkout."""
    name = next(n for n in ATTENTION_FUNCTIONS if hasattr(engine_module, n))
    plain = getattr(engine_module, name)

    def named(*args, **kwargs):
        with record_function(ATTENTION_RANGE):
            return plain(*args, **kwargs)

    setattr(engine_module, name, named)
    try:
        yield
    finally:
        setattr(engine_module, name, plain)


def inside_attention(event) -> bool:
    """Whether a profiled op ran within the decode-attention range (its products with the
    cache are attention, not weight reads)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == ATTENTION_RANGE:
            return True
        parent = parent.cpu_parent
    return False


def decode_steps(engine: Engine, ids: list[int], method: str, steps: int):
    """A prefilled sequence and a function running its next decode step."""
    policy = engine.policy(method).fresh()
    done = engine.prefill_ids(ids, policy, spare=2 * steps + 8)
    state = {"token": int(done.logits.argmax()), "pos": done.next_position}

    def step() -> None:
        logits = engine.decode_step([done.cache], [policy], [state["token"]], [state["pos"]])
        state["token"], state["pos"] = int(logits[0].argmax()), state["pos"] + 1

    return step


def measure(engine: Engine, ids: list[int], method: str, steps: int) -> dict:
    step = decode_steps(engine, ids, method, steps)
    for _ in range(4):  # warm-up
        step()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    with attention_as_a_named_range(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    matmul = attention = 0.0
    for event in prof.events():
        native_attention = event.name == NATIVE_ATTENTION and not inside_attention(event)
        if event.name == ATTENTION_RANGE or native_attention:
            attention += event.cpu_time_total
        elif event.name in WEIGHT_OPS and not inside_attention(event):
            matmul += event.self_cpu_time_total
    wall_ms = 1000 * statistics.median(walls)
    matmul_ms, attention_ms = matmul / 1000 / steps, attention / 1000 / steps
    return {
        "step_ms": wall_ms,
        "matmul_ms": matmul_ms,
        "attention_ms": attention_ms,
        "rest_ms": max(0.0, wall_ms - matmul_ms - attention_ms),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure decode-breakdown", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--methods", default="full;speed:lcut=22,anchors=bos,deep=1")
    parser.add_argument("--modes", default="plain,prepacked", help="plain and/or prepacked")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--weights", default="native", help="native or int8")
    parser.add_argument("--label", default="", help="a name for this engine in the table")
    args = parser.parse_args(argv)
    model = load_model("smollm2-135m", dtype=args.dtype, progress=False)
    if args.weights != "native":
        from speedkv.hf.loading import with_weights

        model = with_weights(model, args.weights)
    engine = Engine(model)
    rows = []
    for mode in args.modes.split(","):
        if mode == "prepacked":
            if not hasattr(model.backbone, "prepack_decode"):
                continue
            model.backbone.prepack_decode()
        for n in (int(x) for x in args.lengths.split(",")):
            ids = model.tokenizer(chat_document(model.tokenizer, n))["input_ids"][:n]
            for method in args.methods.split(";"):
                r = measure(engine, ids, method, args.steps)
                rows.append((args.label or mode, mode, method, n, r))
    print("| engine | mode | method | tokens | step ms | matmuls ms | attention ms | rest ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for label, mode, method, n, r in rows:
        print(
            f"| {label} | {mode} | `{method}` | {n} | {r['step_ms']:.1f} | {r['matmul_ms']:.1f} "
            f"| {r['attention_ms']:.1f} | {r['rest_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
