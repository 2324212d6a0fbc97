"""The engine reads values back from its device a fixed number of times per request and per
token, never per layer: on a GPU every such read (`.item()`, `int(t)`, `bool(t)`, `.tolist()`)
waits for the device to finish, and one per layer would serialise the whole step. Counted on
the CPU by wrapping those methods; the count is the same on any device."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.hf.loading import LoadedModel

from conftest import TINY, random_prompt

READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist")
NEW = 9


def model_with(layers: int) -> LoadedModel:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": layers}))
    return LoadedModel(name=f"tiny-{layers}", hf_model=hf.eval(), tokenizer=None, source="memory")


def reads_of(engine: Engine, spec: str, monkeypatch) -> int:
    request = Request(random_prompt(70), make_policy(spec, engine.shape),
                      SamplingParams(max_new_tokens=NEW))  # fmt: skip
    engine.generate([request])  # first-call work (rope tables, kernels) out of the count
    counts: collections.Counter = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    engine.generate([request])
    monkeypatch.undo()
    return sum(counts.values())


SPECS = [
    "full",
    "speed:lcut=2,anchors=bos,deep=3",
    "speed:lcut=4,deep=1",
    "speed:lcut=2,selfonly=true,deep=1",
]


@pytest.mark.parametrize("spec", SPECS)
def test_reads_do_not_grow_with_depth(spec, monkeypatch):
    shallow = reads_of(Engine(model_with(6), chunk_size=16), spec, monkeypatch)
    deep = reads_of(Engine(model_with(12), chunk_size=16), spec, monkeypatch)
    assert shallow == deep
    # one per generated token (its id), a few per request
    assert deep <= NEW + 4
