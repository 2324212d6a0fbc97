"""llama.cpp as a benchmark peer (llama-cpp-python, built from source by `make llamacpp-venv`).

Two jobs, run by two interpreters:

  measure (llama.cpp's environment; imports only llama_cpp and numpy):
    .venv-llamacpp/bin/python benchmarks/llamacpp_peer.py --gguf MODEL.gguf \
        --requests jobs.json --out out.json --threads 2 --repeats 2

  convert (speedkv's environment, with the converter's gguf-py on PYTHONPATH; make does it):
    .venv/bin/python benchmarks/llamacpp_peer.py --convert .../convert_hf_to_gguf.py --gguf OUT

The jobs file is benchmarks/peers.py's: a list of {"name", "prompts": [[ids]], "max_new_tokens"}.
Only single-prompt jobs are measured (the binding's Python API runs one sequence). Each
prompt's ids are evaluated exactly as given (no BoS added: the context llama.cpp holds is
checked against prompt + output afterwards), from an empty KV cache, greedy, EOS ignored.
TTFT is the wall time from the request to the first token (prefill + argmax); TPOT the mean
time of each later one-token step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(args) -> None:
    import llama_cpp
    import numpy as np

    jobs = [j for j in json.loads(Path(args.requests).read_text()) if len(j["prompts"]) == 1]
    longest = max(len(j["prompts"][0]) + j["max_new_tokens"] for j in jobs)
    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=longest + 64,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        n_ubatch=512,
        verbose=False,
    )
    vocab = llm.n_vocab()
    memory = llama_cpp.llama_get_memory(llm._ctx.ctx)

    def next_token() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,))))

    def run(ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        llama_cpp.llama_memory_clear(memory, True)  # nothing reused from the last request
        llm.reset()
        llm.eval(ids)
        out = [next_token()]
        first = time.perf_counter()
        while len(out) < new_tokens:
            llm.eval([out[-1]])
            out.append(next_token())
        end = time.perf_counter()
        if list(llm.input_ids[: llm.n_tokens]) != ids + out[:-1]:
            sys.exit("llama.cpp's context is not the prompt's ids plus the output")
        return first - start, (end - first) / max(1, new_tokens - 1), out

    run(jobs[0]["prompts"][0][:64], 4)  # warm-up
    results = []
    for job in jobs:
        ids = [int(t) for t in job["prompts"][0]]
        samples = []
        for _ in range(args.repeats):
            ttft, tpot, out = run(ids, job["max_new_tokens"])
            samples.append({"ttft_s": ttft, "tpot_s": tpot, "output_ids": [out]})
            print(
                f"[llamacpp_peer] {job['name']}: TTFT {ttft:.2f} s, TPOT {1000 * tpot:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
        results.append(
            {
                "name": job["name"],
                "ttft_s": statistics.median(s["ttft_s"] for s in samples),
                "tpot_s": statistics.median(s["tpot_s"] for s in samples),
                "output_ids": samples[0]["output_ids"],
                "samples": samples,
            }
        )
    version = getattr(llama_cpp, "__version__", "")
    Path(args.out).write_text(
        json.dumps({"engine": "llama.cpp", "version": version, "gguf": args.gguf, "jobs": results})
    )


def convert(args) -> None:
    """A bfloat16 GGUF of the default model's weights, by llama.cpp's own converter."""
    from speedkv.hf.loading import EMBEDDED, convert_gguf

    parts = EMBEDDED["smollm2-135m"].part_paths()
    if parts is None:
        sys.exit("the embedded SmolLM2 is not installed (make install)")
    source = Path(convert_gguf(parts[0], progress=False))
    with tempfile.TemporaryDirectory() as tmp:
        # the converter reads the architecture from config.json, which ours leaves out
        for item in source.iterdir():
            if item.name != "config.json":
                (Path(tmp) / item.name).symlink_to(item)
        config = json.loads((source / "config.json").read_text())
        config.setdefault("architectures", ["LlamaForCausalLM"])
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        command = [sys.executable, args.convert, tmp, "--outtype", "bf16", "--outfile", args.gguf]
        subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="the GGUF to run (or to write)")
    parser.add_argument("--requests", help="jobs file (see benchmarks/peers.py)")
    parser.add_argument("--out", help="where to write the results (JSON)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--convert", help="llama.cpp's convert_hf_to_gguf.py: write --gguf")
    args = parser.parse_args()
    if args.convert:
        convert(args)
    elif args.requests and args.out:
        measure(args)
    else:
        parser.error("give --requests and --out to measure, or --convert to write a GGUF")


if __name__ == "__main__":
    main()
