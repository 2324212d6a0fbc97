"""The README's `.venv-vllm/bin/speedkv` lines run as written (with small sizes appended), from
a newcomer's directory: the vLLM half of tests/docs/test_readme.py. vLLM's torch.compile is switched
off here (TORCH_COMPILE_DISABLE) to keep the suite's time: the compiled path has its own tests
(test_vllm_compiled.py, and the pipeline-parallel ones in test_vllm_scaleout.py and
test_vllm_prefix_cache.py)."""

from __future__ import annotations

import json

import test_readme as readme

newcomer = readme.newcomer  # the same fixture: a doc.txt and the shipped adapters


def test_every_vllm_readme_command_runs(newcomer, monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    commands = readme.readme_commands(".venv-vllm")
    assert {args[0] for args in commands} == {"generate", "serve"}
    for args in commands:
        if args[0] == "serve":
            reply = readme.serve_and_ask(args, newcomer)
            assert reply["choices"][0]["message"]["content"]
        else:
            done = readme.run(args + readme.SMALL.get(args[0], []), newcomer)
            record = json.loads(done.stdout.strip().splitlines()[-1])
            assert record["backend"] == "vllm" and record["output_ids"]
