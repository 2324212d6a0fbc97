"""Load test of `speedkv serve`: many concurrent streaming chat clients on loopback.

For every method and backend (speedkv's own engine, or vLLM through `--backend vllm`, where
`full` is stock vLLM) it starts a server twice, interleaved in one run so the ratio is measured
under the same machine load: with a batch as large as the client count (continuous batching)
and with --max-batch 1 (the same requests served one at a time). Each client streams one chat
completion of essay text from the `calib` split, prompt lengths mixed; every response must be
complete (its finish chunk, `[DONE]`, exactly --max-tokens tokens since EOS is ignored) and no
request may fail. Reports throughput (generated tokens/s), the batching speed-up, TTFT and
TPOT percentiles, and the peak KV bytes the server held.

    .venv/bin/speedkv measure loadtest --clients 32 --out runs/loadtest
    .venv/bin/speedkv measure loadtest --clients 8 --lengths 64,128 --max-tokens 16  # quick
    .venv-vllm/bin/speedkv measure loadtest --backends speedkv,vllm --modes batched \
        --methods "full;speed:lcut=22,anchors=bos,deep=1" --out benchmarks/vllm/serving

TTFT is measured by the client (request sent -> first content chunk), TPOT too (the rest of the
response over its remaining tokens), so both backends are timed the same way.

Results go to OUT/runs.jsonl (one line per server run; --resume skips runs already there),
OUT/results.json and OUT/table.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

QUESTION = "\n\nSummarise the passage above in one paragraph."
TEMPLATE_OVERHEAD = 40  # tokens the chat template and the question add, roughly


@dataclass
class ClientResult:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # client side: request sent -> first content chunk
    tpot_s: float | None = None  # server side (engine), from the finish chunk
    total_s: float = 0.0
    finish_reason: str | None = None
    done: bool = False  # saw `data: [DONE]`
    error: str | None = None
    text: str = ""  # the streamed content


@dataclass
class RunResult:
    backend: str  # "speedkv" or "vllm"
    method: str
    mode: str  # "batched" or "one-at-a-time"
    max_batch: int
    clients: int
    max_tokens: int
    wall_s: float
    tokens: int
    tokens_per_s: float
    errors: int
    complete: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    peak_kv_bytes: int
    peak_running: int
    peak_kv_usage: float  # vLLM: the largest share of its KV pool in use (0 for speedkv)
    kv_bytes_after: int
    error_samples: list[str] = field(default_factory=list)


# -- prompts -------------------------------------------------------------------------------
def build_prompts(model: str, lengths: list[int], clients: int) -> list[str]:
    """Essay passages from the calib split, cycling through `lengths` (in tokens)."""
    from speedkv.hf.loading import load_tokenizer, model_directory
    from speedkv.prompts.haystack import haystack_text

    tokenizer = load_tokenizer(model_directory(model, progress=False))
    prompts = []
    for i in range(clients):
        body = max(16, lengths[i % len(lengths)] - TEMPLATE_OVERHEAD)
        prompts.append(haystack_text(tokenizer, body, split="calib", start=97 * i) + QUESTION)
    return prompts


# -- the server ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`speedkv serve` in a subprocess on a free loopback port."""

    def __init__(self, args, method: str, max_batch: int, backend: str,
                 extra: tuple[str, ...] = ()):  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "speedkv.cli.app", "serve",
            "--model", args.model,
            "--method", method,
            "--port", str(self.port),
            "--dtype", args.dtype,
            "--backend", backend,
        ]  # fmt: skip
        env = dict(os.environ)
        if backend == "vllm":
            command += [f"--vllm-arg=--max-num-seqs={max_batch}", "--vllm-arg=--max-model-len=4096"]
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM wants 0.9 of RAM otherwise
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.vllm_cpus)
        else:
            command += ["--fixed-method", "--max-batch", str(max_batch), "--max-queue",
                        str(args.clients + 8), "--log-level", "warning"]  # fmt: skip
            if args.threads:
                command += ["--threads", str(args.threads)]
        self.process = subprocess.Popen([*command, *extra], stdout=subprocess.DEVNULL, env=env)

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not become ready")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# -- clients -------------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> ClientResult:
    result = ClientResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    result.done = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    continue
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    content = choice["delta"].get("content")
                    if content and result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    result.text += content or ""
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as err:
        result.error = f"{type(err).__name__}: {err}"
    result.total_s = time.perf_counter() - start
    if result.ttft_s is not None and result.completion_tokens > 1:
        result.tpot_s = (result.total_s - result.ttft_s) / (result.completion_tokens - 1)
    return result


async def watch_metrics(url: str, peaks: dict, stop: asyncio.Event) -> None:
    """Poll /metrics for the peak KV bytes and batch occupancy while the clients run."""
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            try:
                values = parse_metrics((await client.get(f"{url}/metrics")).text)
                peaks["kv"] = max(peaks["kv"], int(values.get("speedkv_kv_cache_bytes", 0)))
                running = int(values.get("speedkv_requests_running",
                                         values.get("vllm:num_requests_running", 0)))  # fmt: skip
                peaks["running"] = max(peaks["running"], running)
                usage = values.get("vllm:kv_cache_usage_perc", 0.0)  # vLLM: share of its pool
                peaks["kv_usage"] = max(peaks["kv_usage"], usage)
            except httpx.HTTPError:
                pass
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values.setdefault(name.partition("{")[0], float(value))  # vLLM labels its series
    return values


async def run_clients(
    args, url: str, prompts: list[str], backend: str
) -> tuple[list[ClientResult], float, dict]:
    # every response has exactly max_tokens tokens: EOS is ignored (each server's own field)
    ignore_eos = {"ignore_eos": True} if backend == "vllm" else {"speedkv": {"ignore_eos": True}}
    bodies = [
        {
            "model": args.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **ignore_eos,
        }
        for prompt in prompts
    ]
    peaks = {"kv": 0, "running": 0, "kv_usage": 0.0}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_metrics(url, peaks, stop))
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(stream_one(client, url, b)) for b in bodies]
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        wall = time.perf_counter() - start
        for task in pending:  # the run is bounded in time: unfinished clients count as errors
            task.cancel()
    stop.set()
    await watcher
    results = []
    for task in tasks:
        if task in done:
            results.append(task.result())
        else:
            results.append(ClientResult(error=f"not finished within {args.timeout:g} s"))
    return results, wall, peaks


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def measure(args, method: str, mode: str, prompts: list[str], backend: str) -> RunResult:
    max_batch = len(prompts) if mode == "batched" else 1
    print(f"[loadtest] {backend} {method}, {mode} (max batch {max_batch})", file=sys.stderr,
          flush=True)  # fmt: skip
    server = Server(args, method, max_batch, backend)
    try:
        server.wait_ready()
        warm = {
            "model": args.model,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 4,
        }
        httpx.post(f"{server.url}/v1/chat/completions", json=warm, timeout=300).raise_for_status()
        results, wall, peaks = asyncio.run(run_clients(args, server.url, prompts, backend))
        time.sleep(0.5)  # the last sequence leaves the batch at the step after its last token
        after = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    finally:
        server.stop()
    complete = [
        r
        for r in results
        if r.error is None
        and r.done
        and r.finish_reason == "length"
        and r.completion_tokens == args.max_tokens
    ]
    tokens = sum(r.completion_tokens for r in results if r.error is None)
    errors = [r.error for r in results if r.error is not None]
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    tpots = [r.tpot_s for r in results if r.tpot_s is not None]
    return RunResult(
        backend=backend,
        method=method,
        mode=mode,
        max_batch=max_batch,
        clients=len(prompts),
        max_tokens=args.max_tokens,
        wall_s=wall,
        tokens=tokens,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        errors=len(errors),
        complete=len(complete),
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p90_s=percentile(ttfts, 0.9),
        tpot_p50_s=percentile(tpots, 0.5),
        tpot_p90_s=percentile(tpots, 0.9),
        peak_kv_bytes=peaks["kv"],
        peak_running=peaks["running"],
        peak_kv_usage=peaks["kv_usage"],
        kv_bytes_after=int(after.get("speedkv_kv_cache_bytes", -1)),
        error_samples=errors[:3],
    )


# -- report --------------------------------------------------------------------------------
def label(run: dict) -> str:
    """How a table names a server: its method, and the backend unless it is speedkv's own."""
    backend = run.get("backend", "speedkv")
    return run["method"] if backend == "speedkv" else f"{run['method']} (vLLM)"


def speedups(runs: list[dict]) -> dict[str, float]:
    by = {(label(r), r["mode"]): r for r in runs}
    out = {}
    for name in dict.fromkeys(label(r) for r in runs):
        batched, alone = by.get((name, "batched")), by.get((name, "one-at-a-time"))
        if batched and alone and alone["tokens_per_s"] > 0:
            out[name] = batched["tokens_per_s"] / alone["tokens_per_s"]
    return out


def framed(result: dict, table: str) -> str:
    """A results table as its table.md holds it: the command that made it above, the machine
    it ran on below."""
    from speedkv.bench.report import machine_sentence

    return f"Command: `{result['command']}`\n\n{table}\n{machine_sentence(result)}\n"


def markdown(runs: list[dict], gains: dict[str, float]) -> str:
    lines = [
        "| method | mode | clients | tokens | wall s | tokens/s | errors | complete "
        "| TTFT p50 / p90 s | TPOT p50 / p90 ms | peak KV | KV after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if r.get("backend", "speedkv") == "vllm":  # vLLM reports a share of its block pool
            peak, after = f"{r.get('peak_kv_usage', 0) * 100:.0f} % of pool", "-"
        else:
            peak, after = f"{r['peak_kv_bytes'] / 2**20:.1f} MiB", str(r["kv_bytes_after"])
        lines.append(
            f"| `{label(r)}` | {r['mode']} | {r['clients']} | {r['tokens']} "
            f"| {r['wall_s']:.1f} | {r['tokens_per_s']:.1f} | {r['errors']} "
            f"| {r['complete']}/{r['clients']} "
            f"| {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} "
            f"| {r['tpot_p50_s'] * 1000:.0f} / {r['tpot_p90_s'] * 1000:.0f} "
            f"| {peak} | {after} |"
        )
    lines.append("")
    for method, gain in gains.items():
        lines.append(f"- batching speed-up for `{method}`: {gain:.2f}x tokens/s")
    batched = {
        (r.get("backend", "speedkv"), r["method"]): r for r in runs if r["mode"] == "batched"
    }
    for (backend, method), run in batched.items():
        full = batched.get((backend, "full"))
        if method == "full" or not full or full["tokens_per_s"] <= 0:
            continue
        speed = run["tokens_per_s"] / full["tokens_per_s"]
        line = f"- `{label(run)}` vs `{label(full)}`: {speed:.2f}x tokens/s"
        if backend == "speedkv":
            line += f", {run['peak_kv_bytes'] / max(1, full['peak_kv_bytes']):.2f}x peak KV"
        lines.append(line)
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="speedkv measure loadtest", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--methods",
        default="full;speed:lcut=22,anchors=bos,deep=1",
        help="Method specs separated by ';'.",
    )
    parser.add_argument("--clients", type=int, default=32, help="Concurrent streaming clients.")
    parser.add_argument(
        "--lengths",
        default="64,128,256,512,1024",
        help="Prompt lengths in tokens, cycled over the clients.",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens per response.")
    parser.add_argument(
        "--modes",
        default="batched,one-at-a-time",
        help="batched (max batch = clients) and/or one-at-a-time (max batch 1).",
    )
    parser.add_argument(
        "--backends",
        default="speedkv",
        help="speedkv and/or vllm (`speedkv serve --backend vllm`; needs vLLM installed).",
    )
    parser.add_argument(
        "--vllm-cpus",
        default="0-1",
        help="VLLM_CPU_OMP_THREADS_BIND for vLLM's worker (vLLM's own default, auto, keeps one "
        "core for its engine process: one thread on a 2-core machine).",
    )
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16.")
    parser.add_argument("--threads", type=int, default=None, help="Server torch threads.")
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="Seconds a run's clients may take in all; later ones are errors.",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/loadtest"))
    parser.add_argument("--resume", action="store_true", help="Skip runs already in OUT.")
    parser.add_argument("--json", action="store_true", help="Print results.json to stdout.")
    args = parser.parse_args(argv)  # fmt: skip
    args.methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not set(args.backends) <= {"speedkv", "vllm"}:
        parser.error("backends are 'speedkv' and 'vllm'")
    if args.clients < 1 or args.max_tokens < 1 or not args.methods or not args.lengths:
        parser.error("clients, max-tokens, methods and lengths must be non-empty and positive")
    if any(n < 16 for n in args.lengths):
        parser.error("prompt lengths must be at least 16 tokens")
    if not set(args.modes) <= {"batched", "one-at-a-time"}:
        parser.error("modes are 'batched' and 'one-at-a-time'")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "runs.jsonl"
    settings = {
        "model": args.model,
        "clients": args.clients,
        "lengths": args.lengths,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "threads": args.threads,
        "vllm_cpus": args.vllm_cpus if "vllm" in args.backends else None,
    }
    runs = []
    if args.resume and log_path.exists():
        runs = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        runs = [r for r in runs if r.get("settings") == settings]
    elif log_path.exists():
        log_path.unlink()
    wanted = [(b, m, mode) for m in args.methods for b in args.backends for mode in args.modes]
    done = {(r.get("backend", "speedkv"), r["method"], r["mode"]) for r in runs}
    todo = [key for key in wanted if key not in done]
    if todo:
        prompts = build_prompts(args.model, args.lengths, args.clients)
        for backend, method, mode in todo:
            record = {**asdict(measure(args, method, mode, prompts, backend)),
                      "settings": settings}  # fmt: skip
            runs.append(record)
            with log_path.open("a") as log:
                log.write(json.dumps(record) + "\n")
    order = {key: i for i, key in enumerate(wanted)}

    def key(run: dict) -> tuple:
        return run.get("backend", "speedkv"), run["method"], run["mode"]

    runs = sorted((r for r in runs if key(r) in order), key=lambda r: order[key(r)])
    gains = speedups(runs)
    from speedkv.bench.machine import machine_facts

    result = {
        "settings": settings,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "cpu_count": os.cpu_count(),
        "machine": machine_facts(),
        "runs": runs,
        "batching_speedup": gains,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    table = framed(result, markdown(runs, gains))
    (args.out / "table.md").write_text(table)
    print(json.dumps(result, indent=2) if args.json else table)
    failed = sum(r["errors"] + r["clients"] - r["complete"] for r in runs)
    if failed:
        print(f"[loadtest] {failed} responses failed or were incomplete", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
