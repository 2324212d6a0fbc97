#!/usr/bin/env python3
"""Peer benchmark: vLLM's CPU build on the same token-id prompts as speedkv.

Run it with the *vLLM* venv's interpreter (`make vllm-venv`: vLLM, and speedkv for
the timing it shares with `speedkv bench --backend vllm`, speedkv.vllm.timing, imported
after torch so that speedkv's OpenMP default never reaches vLLM), e.g.::

    nice -n 10 /work/vllm-probe/.venv/bin/python benchmarks/vllm_peer.py \
        --model /root/.cache/speedkv/models/SmolLM2-135M-Instruct.Q4_1-<hash> \
        --dtype bfloat16 --mode eager --threads 2 \
        --requests jobs.json --out vllm.json

Requests file: a JSON list of jobs::

    [{"name": "ttft_2k", "prompts": [[ids...]], "max_new_tokens": 16},
     {"name": "batch8", "prompts": [[ids...], ...x8], "max_new_tokens": 16}]

Prompts are passed to vLLM as token ids (``TokensPrompt``), never re-tokenized;
outputs are not detokenized (``detokenize=False``).  (The tokenizer is still
loaded: with ``skip_tokenizer_init=True`` vLLM logs a chat-template warm-up
traceback and "Using None for EOS token id".)  Decoding is greedy
(temperature 0), ``ignore_eos=True`` so every request produces exactly
``max_new_tokens`` tokens, seed 0.  Note: in bfloat16 the greedy ids depend on
the thread count and on eager vs compiled (near-ties, especially with
random-token prompts); each configuration is deterministic run to run.

One ``LLM`` is built for all jobs with prefix caching OFF (repeated prompts are
recomputed), ``max_model_len`` = longest prompt + its max_new_tokens (+8),
``max_num_seqs`` = largest batch, and an explicit KV-cache size computed from the
model config so that the largest batch fits entirely (see --kv-cache-gib):
KV bytes/token = 2 * layers * kv_heads * head_dim * dtype_bytes (SmolLM2-135M,
bf16: 2*30*3*64*2 = 23,040 B; 32 sequences of 2,100 tokens = 1.44 GiB, 1.49 GiB
with 128-token blocks).  An explicit size is needed anyway: without it the CPU
worker wants 0.9 * total RAM (``gpu_memory_utilization``) and refuses to start
if that much is not free.

Threads / core binding
----------------------
vLLM CPU decides the worker's OpenMP binding in
``vllm/utils/ompmultiprocessing.py`` (``OMPProcessManager``), only when the model
runs in a separate worker process (``MultiprocExecutor``).  The knob is
``VLLM_CPU_OMP_THREADS_BIND``: ``auto`` (default: the cores of one NUMA node
minus the reserved ones -- ``VLLM_CPU_NUM_OF_RESERVED_CPU``, default 1 core for
the engine-core process -- hence 1 thread on a 2-core box), ``nobind``, or an
explicit CPU list per rank such as ``"0-1"`` or ``"0,1"`` (ranks separated by
``|``; with an explicit list nothing is reserved).  From that list vLLM sets,
in the worker's environment before spawning it, ``OMP_NUM_THREADS=<len>`` and
(because platforms/cpu.py has put torch's own libgomp into ``LD_PRELOAD``)
``GOMP_CPU_AFFINITY="0 1"``: one core per OpenMP thread.  (Without libgomp in
LD_PRELOAD it would use ``OMP_PLACES={0,1}`` + ``OMP_PROC_BIND=true``.)

This script supports both process layouts (``--procs``):

* ``inproc`` (default): ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` -> engine core and
  the (UniProc) worker run inside this process, like a single-process engine.
  vLLM does not bind threads in this layout, so the script reproduces what the
  worker process would get: it re-execs itself once with ``LD_PRELOAD=<torch's
  libgomp>``, ``OMP_NUM_THREADS=N`` and ``GOMP_CPU_AFFINITY="c0 .. cN-1"``
  (libgomp reads them at exec time, so they must be set before the process
  starts).  No extra process busy-polls a message queue, so N can equal the
  number of cores.
* ``mp``: vLLM's default layout (front end + EngineCore process + worker
  process).  The script sets ``VLLM_CPU_OMP_THREADS_BIND=c0,..,cN-1``.  The
  engine-core process busy-polls (sched_yield) while the worker runs; with N ==
  number of cores it competes with the worker's OpenMP threads.

Either way the script then asks the worker (``LLM.collective_rpc``; in mp mode
this needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which the script sets) for
``torch.get_num_threads()``, its OMP/GOMP variables, the OpenMP runtimes mapped
and the CPU affinity of its threads, stores that under ``"binding"`` and exits
with status 2 if the thread count is not N.

TTFT / TPOT measurement
-----------------------
Single-prompt jobs: the request is generated with ``max_tokens=N`` and
``disable_log_stats=False``, so ``RequestOutput.metrics`` is a
``RequestStateStats`` (vLLM 0.32.0 fields: arrival_time, queued_ts,
scheduled_ts, first_token_ts, last_token_ts, first_token_latency,
num_generation_tokens).  We report, as ``speedkv.vllm.timing.request_times``
reads them (the one way speedkv times vLLM)

* ``ttft_s = metrics.first_token_latency`` (front end wall clock from the
  request's arrival to the arrival of its first token; includes the whole
  prefill),
* ``tpot_s = (last_token_ts - first_token_ts) / (N - 1)`` (engine-core
  timestamps of the first and the last generated token: pure decode steps).

Both come from the *same* request, so no assumption is needed that two runs have
identical prefill time (on a shared, noisy machine that assumption is the main
error of the two-call method).  As a cross-check the two-call wall-clock method
is also run and stored: ``ttft_wall_s`` = wall time of ``generate`` with
``max_tokens=1`` and ``tpot_wall_s = (t_N - t_1) / (N - 1)``.  If metrics are
missing, the wall numbers are used (``timing`` says which).

Batch jobs (several prompts): wall time of one ``llm.generate(all prompts)`` with
``max_tokens=1`` (t_1, all prefills) and with ``max_tokens=N`` (t_N);
``decode_tokens_per_s = B*(N-1)/(t_N-t_1)`` (null if noise makes t_N <= t_1),
``e2e_tokens_per_s = B*N/t_N``, ``ttft_s = t_1`` and
``tpot_s = (t_N-t_1)/(N-1)`` (one decode step of the whole batch).  For
single-prompt jobs ``decode_tokens_per_s = 1/tpot_s`` and the two-call value is
kept as ``decode_tokens_per_s_wall``.

With ``--repeats R`` every measurement is repeated R times; the reported
numbers are medians, raw values are under ``"samples"``.  Before measuring, a
short warm-up generate is run (see --warmup).

Output JSON: {"engine": "vllm-cpu", "vllm_version", "torch_version", "mode",
"dtype", "threads", "procs", "init_s", "binding", "config", "jobs": [{"name",
"num_prompts", "prompt_lens", "max_new_tokens", "ttft_s", "tpot_s",
"decode_tokens_per_s", "e2e_tokens_per_s", "wall_s", "wall_1_s",
"output_ids" (one list per prompt, greedy ids of the max_tokens=N run), ...}]}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

PROG = "vllm_peer"


def log(msg: str) -> None:
    print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vllm_peer.py",
        description=(
            "Benchmark vLLM (CPU build) as a peer engine: greedy generation on "
            "given token-id prompts, TTFT/TPOT for single prompts, throughput "
            "for batches, greedy output ids for token comparison. Run with "
            "the vLLM venv's python. See the module docstring for the exact "
            "measurement method."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="HF model directory (config.json + safetensors).",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="Weight/activation dtype (KV cache uses the same).",
    )
    p.add_argument(
        "--hf-overrides",
        default=None,
        metavar="JSON",
        help="vLLM hf_overrides, e.g. the SPEED architecture and its settings from "
        "speedkv.vllm.engine_args (speedkv's plugin must be installed in this venv).",
    )
    p.add_argument(
        "--mode",
        choices=["default", "eager"],
        default="default",
        help="default = vLLM's torch.compile path (compiles during "
        "LLM construction); eager = enforce_eager=True.",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="Number of OpenMP threads (= cores) of vLLM's worker.",
    )
    p.add_argument(
        "--cpus",
        default=None,
        metavar="LIST",
        help="Explicit core ids to bind, e.g. '0,1' or '2-3' "
        "(length must equal --threads). Default: the first "
        "--threads cores of this process's affinity mask.",
    )
    p.add_argument(
        "--procs",
        choices=["inproc", "mp"],
        default="inproc",
        help="inproc: engine core + worker in this process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0, script binds OMP "
        "threads); mp: vLLM's default multi-process layout "
        "(binding via VLLM_CPU_OMP_THREADS_BIND).",
    )
    p.add_argument(
        "--requests",
        required=True,
        metavar="FILE.json",
        help='JSON list of jobs {"name": str, "prompts": [[ids]], "max_new_tokens": int}.',
    )
    p.add_argument(
        "--out",
        default="-",
        metavar="FILE.json",
        help="Where to write the result JSON ('-' = stdout).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Repeat each measurement this many times; report medians.",
    )
    p.add_argument(
        "--warmup",
        choices=["short", "full", "none"],
        default="short",
        help="short: one generate of <=8 prompts truncated to 256 "
        "tokens, 4 new tokens; full: additionally run each job "
        "once (max_tokens=N) unmeasured before measuring it.",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV cache size in GiB. Default: computed from the model "
        "config so that the largest batch fits at max_model_len "
        "(+10%%). (VLLM_CPU_KVCACHE_SPACE is ignored/unset.)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="Scheduler token budget per step (vLLM CPU default 4096; "
        "longer prompts are prefilled in chunks).",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="after start-up and warm-up (sized by --requests), answer jobs given one JSON a "
        "line on stdin with one '@@result <json>' line each on stdout (one repeat), until "
        "stdin closes: for a caller that interleaves vLLM's runs with its own engine's "
        "(benchmarks/against_vllm.py; speedkv.vllm.timing.serve_jobs).",
    )
    p.add_argument(
        "--cold-compile",
        action="store_true",
        help="mode=default only: use a fresh TORCHINDUCTOR_CACHE_DIR "
        "and VLLM_DISABLE_COMPILE_CACHE=1 so init_s includes a "
        "cold compile (otherwise ~/.cache/vllm/torch_compile_cache "
        "and the Inductor cache make later runs faster).",
    )
    p.add_argument(
        "--log-level", default="WARNING", help="VLLM_LOGGING_LEVEL for vLLM's own logger."
    )
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def parse_id_list(s: str) -> list[int]:
    out: list[int] = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def load_jobs(path: str) -> list[dict]:
    with open(path) as f:
        jobs = json.load(f)
    if not isinstance(jobs, list) or not jobs:
        raise SystemExit(f"{path}: expected a non-empty JSON list of jobs")
    names = set()
    for i, j in enumerate(jobs):
        if not isinstance(j, dict):
            raise SystemExit(f"{path}: job {i} is not an object")
        name = j.get("name", f"job{i}")
        if name in names:
            raise SystemExit(f"{path}: duplicate job name {name!r}")
        names.add(name)
        j["name"] = name
        prompts = j.get("prompts")
        if (
            not isinstance(prompts, list)
            or not prompts
            or not all(isinstance(p, list) and p for p in prompts)
        ):
            raise SystemExit(
                f"{path}: job {name!r}: 'prompts' must be a non-empty "
                "list of non-empty token-id lists"
            )
        for p in prompts:
            if not all(isinstance(t, int) and t >= 0 for t in p):
                raise SystemExit(f"{path}: job {name!r}: token ids must be ints >= 0")
        n = j.get("max_new_tokens")
        if not isinstance(n, int) or n < 1:
            raise SystemExit(f"{path}: job {name!r}: 'max_new_tokens' must be an int >= 1")
    return jobs


# --------------------------------------------------------------------------- env


def _torch_libgomp() -> str | None:
    """Path of torch's bundled libgomp, found the way platforms/cpu.py does."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    pkg = os.path.dirname(spec.origin)
    for d in (os.path.join(os.path.dirname(pkg), "torch.libs"), os.path.join(pkg, "lib")):
        found = sorted(glob.glob(os.path.join(d, "libgomp*.so*")))
        if found:
            return found[0]
    return None


def _set_omp_env(cpus: list[int]) -> None:
    """Mirror OMPProcessManager.configure_omp_envs for an in-process worker."""
    cpu_str = ",".join(str(c) for c in cpus)
    for k in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):
        os.environ.pop(k, None)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    ld = os.environ.get("LD_PRELOAD", "")
    if "libiomp" in ld or "libomp" in ld:
        os.environ["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{cpu_str}]"
        os.environ["KMP_BLOCKTIME"] = "5"
        os.environ["KMP_TPAUSE"] = "0"
    elif "libgomp" in ld:
        os.environ["GOMP_CPU_AFFINITY"] = " ".join(str(c) for c in cpus)
    else:
        os.environ["OMP_PLACES"] = "{" + cpu_str + "}"
        os.environ["OMP_PROC_BIND"] = "true"


def maybe_reexec_with_libgomp(cpus: list[int]) -> None:
    """inproc only: re-exec this script with LD_PRELOAD=<torch's libgomp>.

    vLLM's CPU platform (platforms/cpu.py) puts torch's libgomp into LD_PRELOAD
    before it spawns the engine-core/worker processes ("otherwise only one core
    will be properly utilized when we thread-bind", vllm issue 27369), and the
    worker then gets GOMP_CPU_AFFINITY (one core per OpenMP thread).  An
    in-process worker can only get the same setup if this process was started
    with that LD_PRELOAD, hence the one-time re-exec.
    """
    ld = os.environ.get("LD_PRELOAD", "")
    if any(x in ld for x in ("libgomp", "libiomp", "libomp")):
        return
    if os.environ.get("VPEER_REEXEC") == "1":
        return
    gomp = _torch_libgomp()
    if gomp is None:
        return
    # Compute the binding env as it will be after the re-exec, then exec.
    os.environ["LD_PRELOAD"] = f"{ld}:{gomp}" if ld else gomp
    _set_omp_env(cpus)
    os.environ["VPEER_REEXEC"] = "1"
    os.environ["VPEER_CPUS"] = ",".join(str(c) for c in cpus)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def setup_env(args) -> list[int]:
    """Set env vars; must run before torch / vllm are imported."""
    allowed = sorted(os.sched_getaffinity(0))
    if os.environ.get("VPEER_REEXEC") == "1" and os.environ.get("VPEER_CPUS"):
        # Re-exec'd child: libgomp already pinned this (main) thread to cpus[0],
        # so the affinity mask no longer shows all cores; reuse the parent's list.
        cpus = parse_id_list(os.environ["VPEER_CPUS"])
    elif args.cpus:
        cpus = parse_id_list(args.cpus)
        if len(cpus) != args.threads:
            raise SystemExit(f"--cpus has {len(cpus)} ids but --threads is {args.threads}")
        bad = [c for c in cpus if c not in allowed]
        if bad:
            raise SystemExit(f"--cpus {bad} not in this process's affinity {allowed}")
    else:
        if args.threads > len(allowed):
            raise SystemExit(f"--threads {args.threads} > allowed cores {allowed}")
        cpus = allowed[: args.threads]
    cpu_str = ",".join(str(c) for c in cpus)

    if args.procs == "inproc":
        # Before any other env: LD_PRELOADed libgomp reads GOMP_*/OMP_* at exec.
        maybe_reexec_with_libgomp(cpus)
    os.environ["VLLM_LOGGING_LEVEL"] = args.log_level.upper()
    # vLLM logs to stdout by default; keep stdout for the JSON (--out -).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.cold_compile:
        import tempfile

        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="vllm_peer_inductor_")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # KV size is passed explicitly (kv_cache_memory_bytes); the legacy env var
    # would override it inside platforms/cpu.py, so drop it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # vLLM's own knob; only read by the multiprocess executor.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_str
    if args.procs == "inproc":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Same values vLLM's OMPProcessManager.configure_omp_envs sets for a
        # worker process (which sees LD_PRELOAD=torch's libgomp, see
        # maybe_reexec_with_libgomp).
        _set_omp_env(cpus)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        for k in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND"):
            os.environ.pop(k, None)
        # Needed to send the binding probe (a Python callable) to the worker.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return cpus


def _worker_probe(worker):
    """Runs inside vLLM's worker (via collective_rpc)."""
    import os as _os

    import torch as _torch

    aff: dict[str, int] = {}
    try:
        for tid in _os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("Cpus_allowed_list:"):
                            k = line.split(":", 1)[1].strip()
                            aff[k] = aff.get(k, 0) + 1
            except OSError:
                pass
    except OSError:
        pass
    init_env = {}
    try:
        with open("/proc/self/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                k, _, v = kv.decode(errors="replace").partition("=")
                if k.startswith(("OMP_", "GOMP_", "KMP_")):
                    init_env[k] = v
    except OSError:
        pass
    omp_libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                base = _os.path.basename(path)
                if base.startswith(("libgomp", "libiomp", "libomp", "libtcmalloc")):
                    omp_libs.add(path)
    except OSError:
        pass
    ct = None
    try:
        # torch._dynamo's own timers (vLLM's compilation_time stays 0 on CPU,
        # whose default mode is DYNAMO_TRACE_ONCE, not VLLM_COMPILE).
        from torch._dynamo.utils import compile_times

        hdr, row = compile_times(repr="csv", aggregate=True)
        ct = {h: float(v) for h, v in zip(hdr, row)}
    except Exception:
        pass
    return {
        "pid": _os.getpid(),
        "torch_num_threads": _torch.get_num_threads(),
        "OMP_NUM_THREADS": _os.environ.get("OMP_NUM_THREADS"),
        "OMP_PLACES": _os.environ.get("OMP_PLACES"),
        "OMP_PROC_BIND": _os.environ.get("OMP_PROC_BIND"),
        "thread_affinity_counts": aff,
        "exec_env_omp": init_env,
        "LD_PRELOAD": _os.environ.get("LD_PRELOAD"),
        "omp_libs_mapped": sorted(omp_libs),
        "dynamo_compile_times_s": ct,
    }


# --------------------------------------------------------------------------- main


def _upper_rows(worker):
    return getattr(worker.model_runner.model, "upper_rows", None)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def kv_bytes_per_token(model_dir: str, dtype: str) -> tuple[int, dict]:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    nbytes = 2 if dtype == "bfloat16" else 4
    per_tok = 2 * layers * kv_heads * head_dim * nbytes
    return per_tok, {
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": cfg.get("max_position_embeddings"),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    jobs = load_jobs(args.requests)
    cpus = setup_env(args)

    max_batch = max(len(j["prompts"]) for j in jobs)
    max_total = max(len(p) + j["max_new_tokens"] for j in jobs for p in j["prompts"])
    per_tok, mcfg = kv_bytes_per_token(args.model, args.dtype)
    max_model_len = min(max_total + 8, mcfg["max_position_embeddings"] or max_total + 8)
    if mcfg["max_position_embeddings"] and max_total > mcfg["max_position_embeddings"]:
        raise SystemExit(
            f"longest prompt + max_new_tokens = {max_total} > "
            f"max_position_embeddings {mcfg['max_position_embeddings']}"
        )
    block = 128  # vLLM CPU default block size
    if args.kv_cache_gib is not None:
        kv_bytes = int(args.kv_cache_gib * (1 << 30))
    else:
        blocks_per_seq = math.ceil(max_model_len / block) + 1
        kv_bytes = int(max_batch * blocks_per_seq * block * per_tok * 1.1)
        kv_bytes = max(kv_bytes, 64 << 20)

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)

    import logging

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    # after torch: speedkv sets its OpenMP spin count only where torch is not loaded yet
    from speedkv.vllm.timing import request_times, serve_jobs, timed_generate

    class _DropWeightDtypeSpam(logging.Filter):
        # one WARNING per weight when a float32 checkpoint is loaded as bf16
        def filter(self, record):
            return not str(record.msg).startswith("Attempted to load weight")

    # in-process only (in --procs mp the weights are loaded in the worker)
    logging.getLogger("vllm.model_executor.models.utils").addFilter(_DropWeightDtypeSpam())

    log(
        f"vllm {vllm.__version__} torch {torch.__version__} procs={args.procs} "
        f"mode={args.mode} dtype={args.dtype} threads={args.threads} cpus={cpus} "
        f"max_model_len={max_model_len} max_num_seqs={max_batch} "
        f"kv_cache={kv_bytes / (1 << 30):.2f}GiB"
    )

    llm_kwargs = dict(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=(args.mode == "eager"),
        seed=0,
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        max_num_seqs=max_batch,
        kv_cache_memory_bytes=kv_bytes,
        disable_log_stats=False,  # needed for RequestOutput.metrics
        use_tqdm_on_load=False,
    )
    if args.max_num_batched_tokens:
        llm_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.hf_overrides:
        llm_kwargs["hf_overrides"] = json.loads(args.hf_overrides)
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs)
    init_s = time.perf_counter() - t0
    log(f"LLM init {init_s:.1f}s")

    vcfg = llm.llm_engine.vllm_config
    cache_cfg = vcfg.cache_config
    config_info = {
        "block_size": cache_cfg.block_size,
        "enable_prefix_caching": cache_cfg.enable_prefix_caching,
        "kv_cache_memory_bytes": kv_bytes,
        "kv_cache_blocks": getattr(cache_cfg, "num_gpu_blocks", None),
        "kv_bytes_per_token": per_tok,
        "enable_chunked_prefill": vcfg.scheduler_config.enable_chunked_prefill,
        "max_num_batched_tokens": vcfg.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": vcfg.scheduler_config.max_num_seqs,
        "max_model_len": vcfg.model_config.max_model_len,
        "compilation_mode": getattr(
            vcfg.compilation_config.mode, "name", str(vcfg.compilation_config.mode)
        ),
        "executor": str(vcfg.parallel_config.distributed_executor_backend),
    }
    blocks = config_info["kv_cache_blocks"]
    if blocks and cache_cfg.block_size:
        need = max_batch * math.ceil(max_total / cache_cfg.block_size)
        if blocks < need:
            log(
                f"WARNING: KV cache has {blocks} blocks but the largest batch needs "
                f"{need}; requests will be queued/preempted. Raise --kv-cache-gib."
            )

    def gen(prompts, n):
        sp = SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False, seed=0
        )
        return timed_generate(llm, prompts, sp)

    # ---- warm-up
    if args.warmup != "none":
        wp = [j["prompts"][0][:256] for j in jobs][:8]
        wt, _ = gen(wp, 4)
        log(f"warm-up ({len(wp)} prompts, 4 tokens) {wt:.2f}s")

    # ---- binding check (after a generate, so the OMP pool exists)
    try:
        probes = llm.collective_rpc(_worker_probe)
    except Exception as e:  # pragma: no cover
        probes = [{"error": repr(e)}]
    binding = {
        "procs": args.procs,
        "cpus": cpus,
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "workers": probes,
    }
    nthreads = [pr.get("torch_num_threads") for pr in probes]
    log(
        f"worker torch.get_num_threads()={nthreads} "
        f"affinity={[pr.get('thread_affinity_counts') for pr in probes]}"
    )
    if any(n != args.threads for n in nthreads):
        log(f"ERROR: worker uses {nthreads} threads, requested {args.threads}")
        return 2
    compile_s = None
    ct = probes[0].get("dynamo_compile_times_s") if probes else None
    if ct:
        # "fullgraph_capture" is Dynamo's outermost timer (tracing + AOT
        # autograd + Inductor codegen) in torch 2.13; fall back to the max.
        compile_s = ct.get("fullgraph_capture") or max(ct.values())
        log(f"torch.compile time {compile_s:.1f}s (of LLM init {init_s:.1f}s)")

    # ---- jobs
    def measure_job(j: dict, repeats: int) -> dict:
        name, prompts, n = j["name"], j["prompts"], j["max_new_tokens"]
        b = len(prompts)
        if args.warmup == "full":
            gen(prompts, n)
        s = {"wall_1_s": [], "wall_s": [], "ttft_metrics_s": [], "tpot_metrics_s": []}
        output_ids = None
        first_ok = True
        for _ in range(repeats):
            t1, outs1 = gen(prompts, 1)
            tn, outs = gen(prompts, n)
            s["wall_1_s"].append(t1)
            s["wall_s"].append(tn)
            ids = [list(o.outputs[0].token_ids) for o in outs]
            ids1 = [list(o.outputs[0].token_ids) for o in outs1]
            first_ok &= all(a[:1] == c[:1] for a, c in zip(ids, ids1))
            if output_ids is None:
                output_ids = ids
            elif ids != output_ids:
                log(f"WARNING: job {name}: greedy output ids differ between repeats")
            if b == 1:
                times = request_times(outs[0])
                s["ttft_metrics_s"].append(times.ttft_s if times else None)
                s["tpot_metrics_s"].append(times.tpot_s if times and n > 1 else None)

        t1, tn = median(s["wall_1_s"]), median(s["wall_s"])
        tpot_wall = (tn - t1) / (n - 1) if n > 1 and tn > t1 else None
        if n > 1 and tn <= t1:
            log(
                f"WARNING: job {name}: t_N={tn:.3f}s <= t_1={t1:.3f}s (noise); "
                "wall-clock decode numbers set to null"
            )
        r = {
            "name": name,
            "num_prompts": b,
            "prompt_lens": [len(p) for p in prompts],
            "max_new_tokens": n,
            "wall_1_s": t1,
            "wall_s": tn,
            "ttft_wall_s": t1,
            "tpot_wall_s": tpot_wall,
            "e2e_tokens_per_s": b * n / tn,
            "decode_tokens_per_s": b / tpot_wall if tpot_wall else None,
            "first_token_consistent": first_ok,
            "output_ids": output_ids,
            "samples": {k: v for k, v in s.items() if v},
        }
        ttft_m, tpot_m = median(s["ttft_metrics_s"]), median(s["tpot_metrics_s"])
        if b == 1 and ttft_m is not None and (n == 1 or tpot_m is not None):
            r["timing"] = "request_metrics"
            r["ttft_s"], r["tpot_s"] = ttft_m, tpot_m
            r["ttft_metrics_s"], r["tpot_metrics_s"] = ttft_m, tpot_m
        else:
            r["timing"] = "wall_two_call"
            r["ttft_s"], r["tpot_s"] = t1, tpot_wall
        if b == 1:
            # keep decode_tokens_per_s consistent with the reported tpot_s
            r["decode_tokens_per_s_wall"] = r["decode_tokens_per_s"]
            r["decode_tokens_per_s"] = 1.0 / r["tpot_s"] if r["tpot_s"] else None

        def f(x, unit="s", scale=1.0):
            return "-" if x is None else f"{x * scale:.3f}{unit}"

        log(
            f"job {name}: B={b} len={max(r['prompt_lens'])} N={n} "
            f"ttft={f(r['ttft_s'])} tpot={f(r['tpot_s'], 'ms', 1e3)} "
            f"(wall: t1={t1:.3f}s tN={tn:.3f}s) decode={f(r['decode_tokens_per_s'], 'tok/s')} "
            f"e2e={r['e2e_tokens_per_s']:.1f}tok/s [{r['timing']}]"
        )
        return r

    if args.serve:
        serve_jobs(lambda job: measure_job(job, 1), {"vllm_version": vllm.__version__,
                   "mode": args.mode, "threads": args.threads, "config": config_info})  # fmt: skip
        return 0
    results = [measure_job(j, args.repeats) for j in jobs]

    out = {
        "engine": "vllm-cpu",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "mode": args.mode,
        "dtype": args.dtype,
        "threads": args.threads,
        "procs": args.procs,
        "model": os.path.abspath(args.model),
        "init_s": init_s,
        "compile_s": compile_s,
        "cold_compile": bool(args.cold_compile),
        "binding": binding,
        "config": config_info,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "jobs": results,
        "hf_overrides": llm_kwargs.get("hf_overrides"),
        # rows the SPEED model sent through its upper layers over the whole run (None: stock)
        "upper_rows": llm.collective_rpc(_upper_rows)[0],
    }
    text = json.dumps(out, indent=1)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
