"""`speedkv doctor` and `speedkv tune`: this machine, its kernels and the choice between them."""

from __future__ import annotations

import json

import typer

from speedkv.cli.options import AsJson

commands = typer.Typer()


@commands.command()
def doctor(as_json: AsJson = False) -> None:
    """Print this machine (CPU, the instruction sets speedkv's and torch's kernels choose
    between, cores, memory, torch and oneDNN versions), the compiler's target, whether each
    native kernel is built, and which kernel runs each kind of work here (SPEEDKV_KERNELS
    overrides: auto, native or torch)."""
    from speedkv.bench.machine import machine_facts

    facts = machine_facts()
    if as_json:
        print(json.dumps(facts, indent=2))
        return
    print(f"cpu: {facts['cpu']} ({facts['cores']} cores available, "
          f"{facts['memory_gib']} GiB memory)")  # fmt: skip
    print(f"threads: {facts['threads']}, waiting as {facts['openmp_wait']}")
    print(f"instruction sets: {', '.join(facts['isa']) or 'none of the ones that matter'}")
    print(f"torch {facts['torch']}, oneDNN {facts['onednn']}, transformers "
          f"{facts['transformers']}")  # fmt: skip
    kernels = facts["kernels"]
    print(f"compiler: {kernels['compiler']}")
    for name, state in kernels["built"].items():
        print(f"native {name} kernel: {state}")
    print(f"kernel choice ({kernels['mode']}):")
    for line in kernels["choice"]:
        print(f"  {line}")


@commands.command()
def tune(as_json: AsJson = False) -> None:
    """Time speedkv's native kernels against torch's on this machine again and store which one
    runs each kind of work (done once by itself, when the kernels are first built here; run it
    again after changing the machine's load, its threads or torch)."""
    from dataclasses import asdict

    from speedkv.kernels.tuning import tune as measure

    choice = measure()
    if as_json:
        print(json.dumps(asdict(choice), indent=2))
        return
    for line in choice.lines():
        print(line)
    for kind, pair in choice.timings.items():
        print(f"  {kind}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in pair.items()))
