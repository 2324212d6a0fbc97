"""RULER's own client and scorer against `speedkv serve`, checked against `speedkv eval`.

For each method it starts `speedkv serve --method METHOD`, runs the prediction client and the
scorer of NVIDIA's `nvidia-long-context-eval` over the RULER samples that
`speedkv eval --tasks ruler/...` answers in-process (that run is made first, or resumed), stops
the server, and compares the two sample by sample (speedkv.evals.ruler_served says how the
routes lay out the prompts):

    .venv/bin/speedkv measure ruler-served --methods "full;speed" \\
        --tasks niah_single_1,niah_multikey_1,vt,qa_1 --length 4096 --samples 4 \\
        --out benchmarks/ruler-served          # make ruler-served

Writes OUT/results.json (settings, per-task and per-sample rows with both answers) and
OUT/table.md; the client's data, predictions and logs, the in-process run and the servers' logs
stay under --work. The server is stopped on every exit, a failure or Ctrl-C included.

It sits in the leaderboard layer, not in speedkv.bench.measure with the other measurements: it
renders the served board (speedkv.leaderboard.served), which the bench layer may not import.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from speedkv.errors import UserError
from speedkv.evals import ruler, ruler_served
from speedkv.hf.loading import load_tokenizer, model_directory
from speedkv.leaderboard.served import compare, served_page

SERVER_START_S = 600  # loading (and on first use converting) the model
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="speedkv measure ruler-served", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="full;speed", help="';'-separated method specs")
    parser.add_argument("--tasks", default="niah_single_1,niah_multikey_1,vt,qa_1")
    parser.add_argument("--length", type=int, default=4096, help="RULER's length")
    parser.add_argument("--samples", type=int, default=4, help="samples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument(
        "--routes",
        default="completion,chat",
        help="completion (prompts token-identical to the in-process ones) and/or chat (the "
        "saved input as a user message)",
    )
    parser.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=0,
        help="the server's prefix cache; off by default, since a prompt that reuses a cached "
        "prefix is prefilled in two pieces and equal to one prefill only up to rounding (in "
        "bfloat16, 7 of 32 answers at 4K differ with it on; none in float32)",
    )
    parser.add_argument("--ruler-data", type=Path, default=None, help="default $SPEEDKV_CACHE")
    parser.add_argument("--work", type=Path, default=Path("runs/ruler-served"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/ruler-served"))
    parser.add_argument("--command", default=None, help="the command quoted in the outputs")
    return parser.parse_args(argv)


# -- the in-process run -----------------------------------------------------------------------
def speedkv_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "speedkv.cli.app", *args]


def run_inprocess(args: argparse.Namespace, tasks: list[str], methods: list[str]) -> dict:
    """`speedkv eval` on the same tasks, length, samples and seed (resumed: records already
    there are kept); its results.json."""
    out = args.work / "in-process"
    command = speedkv_command(
        "eval", "--model", args.model, "--methods", ";".join(methods),
        "--tasks", ",".join(tasks), "--lengths", str(args.length),
        "--samples", str(args.samples), "--seed", str(args.seed), "--dtype", args.dtype,
        "--threads", str(args.threads), "--out", str(out), "--resume",
    )  # fmt: skip
    if args.ruler_data is not None:
        command += ["--ruler-data", str(args.ruler_data)]
    print(f"in-process: {' '.join(command[3:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        raise UserError(f"speedkv eval failed (exit code {done.returncode})")
    return json.loads((out / "results.json").read_text())


# -- the server -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> dict:
    with NO_PROXY.open(url, timeout=timeout) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def speedkv_server(args: argparse.Namespace, method: str, log_path: Path) -> Iterator[tuple]:
    """`speedkv serve --method METHOD` on a free loopback port until the block ends, however
    it ends; yields (url, the model card of /v1/models)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = speedkv_command(
        "serve", "--model", args.model, "--method", method, "--port", str(port),
        "--dtype", args.dtype, "--threads", str(args.threads),
        "--prefix-cache-bytes", str(args.prefix_cache_bytes), "--log-level", "warning",
    )  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        # a session of its own, so stopping it stops everything it started
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            card = wait_ready(process, url, log_path)
            yield url, card
        finally:
            stop(process)


def wait_ready(process: subprocess.Popen, url: str, log_path: Path) -> dict:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise UserError(f"speedkv serve exited with code {process.returncode}:\n{tail}")
        with contextlib.suppress(OSError, ValueError):
            if get_json(f"{url}/health").get("status") == "ok":
                return get_json(f"{url}/v1/models")["data"][0]
        time.sleep(0.5)
    raise UserError(f"speedkv serve was not ready after {SERVER_START_S} s; its log: {log_path}")


def stop(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait)


# -- the run ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.command = args.command or shlex.join(["speedkv", "measure", "ruler-served", *argv])
    # SIGTERM (a killed make) unwinds like Ctrl-C, so the server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        run(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    ruler_served.require(routes)
    tasks = [t if ruler.is_ruler(t) else ruler.PREFIX + t for t in args.tasks.split(",")]
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    root = ruler.data_root(args.ruler_data)

    inprocess = run_inprocess(args, tasks, methods)
    records = inprocess["records"]
    tokenizer = load_tokenizer(model_directory(args.model, progress=False))

    samples, rows, servers = [], [], {}
    for method in methods:
        log_path = args.work / "servers" / f"{len(servers)}.log"
        with speedkv_server(args, method, log_path) as (url, card):
            spec = card["speedkv"]["method"]  # canonical, as the in-process records name it
            servers[method] = {"spec": spec, "url": url, "log": str(log_path)}
            for route in routes:
                print(f"served: {spec}, {route} route", file=sys.stderr, flush=True)
                work = args.work / "served" / f"{len(servers) - 1}-{route}"
                served = ruler_served.run_route(
                    tokenizer, route, url, card["id"], card["speedkv"]["context"], tasks,
                    args.length, args.seed, args.samples, root, work,
                )  # fmt: skip
                per_sample, per_task = compare(served, records, spec, args.length)
                samples += per_sample
                rows += per_task

    result = {
        "command": args.command,
        "model": args.model,
        "dtype": inprocess["header"].get("dtype"),
        "tasks": tasks,
        "length": args.length,
        "samples": args.samples,
        "seed": args.seed,
        "routes": routes,
        "servers": servers,
        "package": f"{ruler.PACKAGE} {ruler.package_version()}",
        "client": "pred/call_api.py --threads 1 --temperature 0 --top_p 1.0; completion: "
        "--server_type generic_oai_server --generic_oai_server_mode completion; chat: "
        "--server_type openai",
        "scorer": "eval/evaluate.py --benchmark synthetic",
        "server": f"speedkv serve --prefix-cache-bytes {args.prefix_cache_bytes}",
        "versions": inprocess["versions"],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "elapsed_s": round(time.perf_counter() - started, 1),
        "tasks_table": rows,
        "per_sample": samples,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    table = served_page(result)
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
