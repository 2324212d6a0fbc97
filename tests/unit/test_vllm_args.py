"""The vLLM backend's parts that run without vLLM: which rows of a step are full depth (the
SPEED rule, in vLLM's flattened layout) and the method spec -> engine arguments checks."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from speedkv.errors import UserError
from speedkv.methods.speed import SpeedRule
from speedkv.vllm.args import engine_args, require_vllm
from speedkv.vllm.compact import (
    Layout,
    RequestLayout,
    compact_length,
    compact_slots,
    full_depth_rows,
    requests_short_of_blocks,
    step_positions,
)

from helpers import run_cli


def random_step(gen: torch.Generator, requests: int):
    """A step of mixed requests: each has a prompt, a number of tokens already computed and
    a chunk scheduled now (prefill chunks, a last chunk, decode steps, recomputations)."""
    prompt = torch.randint(1, 60, (requests,), generator=gen)
    total = prompt + torch.randint(0, 6, (requests,), generator=gen)  # prompt + generated
    done = (torch.rand(requests, generator=gen) * total).long()
    chunk = torch.minimum(total - done, torch.randint(1, 40, (requests,), generator=gen))
    positions = torch.cat([torch.arange(d, d + c) for d, c in zip(done, chunk)])
    query_start = torch.zeros(requests + 1, dtype=torch.int32)
    query_start[1:] = chunk.cumsum(0)
    return positions, query_start, done + chunk, prompt


@pytest.mark.parametrize("anchors", [0, 1, 4])
@pytest.mark.parametrize("deep", [1, 3])
def test_full_depth_rows_follow_the_speed_rule(anchors, deep):
    gen = torch.Generator().manual_seed(anchors * 10 + deep)
    for _ in range(30):
        positions, query_start, seq_lens, prompt = random_step(gen, 5)
        found = full_depth_rows(positions, query_start, seq_lens, Layout.of(prompt, anchors, deep))
        rule = SpeedRule(lcut=0, anchors=anchors, deep=deep)
        for r in range(5):
            span = slice(int(query_start[r]), int(query_start[r + 1]))
            want = rule.full_depth(positions[span], int(prompt[r]), deep).nonzero().squeeze(1)
            mine = found.rows[found.row_request == r] - span.start
            assert torch.equal(mine, want)
            # compact index = how many full-depth positions come before it
            every = rule.full_depth(torch.arange(int(seq_lens[r])), int(prompt[r]), deep)
            rank = every.cumsum(0) - 1
            assert torch.equal(found.compact[found.row_request == r],
                               rank[positions[span][want]])  # fmt: skip
            if r in found.requests:
                k = int((found.requests == r).nonzero())
                assert int(found.seq_lens[k]) == int(every.sum())
                queries = found.query_start[k + 1] - found.query_start[k]
                assert int(queries) == want.numel()
        assert torch.equal(
            compact_length(seq_lens, prompt, anchors, deep)[found.requests],
            found.seq_lens.long(),
        )


def test_step_positions_are_each_requests_next_positions():
    """The builder derives positions from the host-side facts, never reading the device's."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        positions, query_start, seq_lens, _ = random_step(gen, 6)
        assert torch.equal(step_positions(query_start, seq_lens), positions)
    empty = torch.tensor([0, 0, 3, 3], dtype=torch.int32)  # requests without rows (padding)
    assert step_positions(empty, torch.tensor([5, 9, 2])).tolist() == [6, 7, 8]


@pytest.mark.parametrize("deep", [1, 3])
def test_a_reused_prefix_keeps_its_rows_and_the_rule_applies_to_new_tokens(deep):
    """A request that reused 8 tokens holding 3 compact rows (say BoS, an earlier request's deep
    suffix at 6 and 7): its rows continue at compact index 3, from its own deep suffix or its
    first new token, whichever comes later."""
    prompt, hit, rows = torch.tensor([12, 9]), torch.tensor([8, 8]), torch.tensor([3, 3])
    layout = Layout.of(prompt, anchors=1, deep=deep, hit_tokens=hit, hit_rows=rows)
    positions = torch.cat([torch.arange(8, 12), torch.arange(8, 9)])  # both prefill the rest
    found = full_depth_rows(positions, torch.tensor([0, 4, 5]), torch.tensor([12, 9]), layout)
    first = [max(8, 12 - deep), max(8, 9 - deep)]
    want = [p for p in range(8, 12) if p >= first[0]] + [8]  # request 1: 8 is its last token
    assert positions[found.rows].tolist() == want
    assert found.compact.tolist() == [3 + p - first[0] for p in want[:-1]] + [3]
    assert found.seq_lens.tolist() == [3 + 12 - first[0], 4]
    # a decode step after it: the next row, the next compact index
    assert layout.length(torch.tensor([13, 10])).tolist() == [4 + 12 - first[0], 5]
    # a fresh request (no hit) keeps the anchors and its own suffix, as before
    fresh = Layout.of(prompt, 1, deep, hit_tokens=torch.tensor([0, 0]), hit_rows=rows)
    assert torch.equal(fresh.length(prompt), compact_length(prompt, prompt, 1, deep))


def test_one_request_layout_in_ints_is_the_tensor_layout():
    """The KV manager's per-request layout (plain ints) and the builder's (tensors) agree."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        prompt, hit = (int(x) for x in torch.randint(0, 40, (2,), generator=gen))
        hit = min(hit, prompt) if hit % 3 else 0  # a third of them fresh
        rows = int(torch.randint(0, hit + 1, (1,), generator=gen)) if hit else 0
        anchors = int(torch.randint(0, 4, (1,), generator=gen))
        deep = int(torch.randint(1, 6, (1,), generator=gen))
        seq = hit + int(torch.randint(1, 30, (1,), generator=gen))
        tensor = Layout.of(torch.tensor([prompt]), anchors, deep, torch.tensor([hit]),
                           torch.tensor([rows]))  # fmt: skip
        one = RequestLayout.of(prompt, anchors, deep, hit, rows)
        assert (one.deep_from, one.compact_at) == (int(tensor.deep_from), int(tensor.compact_at))
        assert one.rows(seq) == int(tensor.length(torch.tensor([seq])))


def test_requests_short_of_blocks():
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 9])
    found = full_depth_rows(positions, torch.tensor([0, 6, 7]), torch.tensor([6, 10]),
                            Layout.of(torch.tensor([6, 7]), anchors=1, deep=2))  # fmt: skip
    # compact lengths 3 and 6: one 4-slot block, then two
    assert found.seq_lens.tolist() == [3, 6]
    assert requests_short_of_blocks(found, torch.tensor([1, 2]), 4).tolist() == []
    assert requests_short_of_blocks(found, torch.tensor([1, 1]), 4).tolist() == [1]
    assert requests_short_of_blocks(found, torch.tensor([0, 2]), 4).tolist() == [0]


def test_compact_slots_index_each_request_blocks():
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 9])  # request 0 prefills 6, request 1 decodes
    query_start = torch.tensor([0, 6, 7])
    found = full_depth_rows(positions, query_start, torch.tensor([6, 10]),
                            Layout.of(torch.tensor([6, 7]), anchors=1, deep=2))  # fmt: skip
    assert found.rows.tolist() == [0, 4, 5, 6]
    assert found.compact.tolist() == [0, 1, 2, 5]  # request 1 keeps 0, 5, 6, 7, 8, 9
    block_table = torch.tensor([[3, 0], [7, 8]])
    assert compact_slots(block_table, found, 4).tolist() == [12, 13, 14, 33]


def write_config(tmp_path, **fields):
    config = dict(model_type="llama", num_hidden_layers=30, hidden_size=576,
                  num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                  vocab_size=49152, max_position_embeddings=8192)  # fmt: skip
    config.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_engine_args_turn_a_speed_spec_into_overrides(tmp_path):
    directory = write_config(tmp_path)
    args = engine_args("speed:lcut=22,anchors=sink:4,deep=3", directory)
    assert args["hf_overrides"] == {
        "architectures": ["SpeedLlamaForCausalLM"],
        "speedkv_lcut": 22,
        "speedkv_anchors": 4,
        "speedkv_deep": 3,
        "speedkv_compact_kv": True,
    }
    assert "enable_prefix_caching" not in args  # vLLM's own default: on, as with stock models
    # no lcut: the padding-free cut nearest 0.75 L (22 would leave vLLM 2 empty layer slots)
    assert engine_args("speed", directory)["hf_overrides"]["speedkv_lcut"] == 24
    assert engine_args("speed:lcut=30,deep=1", directory) == {}
    assert engine_args("full", directory) == {}
    qwen = engine_args(
        "speed:lcut=18,anchors=none,deep=1", write_config(tmp_path, model_type="qwen2")
    )
    assert qwen["hf_overrides"]["architectures"] == ["SpeedQwen2ForCausalLM"]
    spec = "speed:lcut=18,anchors=none,deep=1"
    for family in ("qwen3", "mistral"):
        name = {"qwen3": "SpeedQwen3ForCausalLM", "mistral": "SpeedMistralForCausalLM"}[family]
        made = engine_args(spec, write_config(tmp_path, model_type=family))
        assert made["hf_overrides"]["architectures"] == [name]


def test_a_model_of_local_and_global_layers_gets_no_padding_guess(tmp_path, capsys):
    """Gemma 3's local and global layers make vLLM group each kind on each side of the cut,
    which the two-kind padding count does not model: no padding note, and the default cut is
    the policy's own 75 % (18 layers: 14), not the two-kind padding-free one."""
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    gemma = write_config(tmp_path, model_type="gemma3_text", num_hidden_layers=18,
                         sliding_window=512, layer_types=kinds * 3, head_dim=256)  # fmt: skip
    assert engine_args("speed:deep=1", gemma)["hf_overrides"]["speedkv_lcut"] == 14
    engine_args("speed:lcut=13,deep=1", gemma)
    assert "pads" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("method", "model_type", "message"),
    [
        ("snapkv", "llama", "runs full and speed"),
        ("speed:lcut=31", "llama", "between 0 and 30"),
        ("speed:lcut=22,deep=header", "llama", "token count"),
        ("speed:lcut=22,selfonly=true,deep=1", "llama", "selfonly"),
        ("speed:lcut=22,deep=1,stride=40", "llama", "stride"),
        ("speed:lcut=22,deep=1", "gpt2", "not supported"),
        ("speed:lcut=22,anchors=bos2,deep=1", "llama", "anchors must be"),
    ],
)
def test_engine_args_refuse_what_vllm_cannot_run(tmp_path, method, model_type, message):
    with pytest.raises(UserError, match=message):
        engine_args(method, write_config(tmp_path, model_type=model_type))


def test_engine_args_need_a_model_directory(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        engine_args("speed", tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_missing_vllm_names_the_make_target():
    with pytest.raises(UserError, match="make vllm-venv"):
        require_vllm()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--backend", "tpu"], "backend must be speedkv or vllm"),
        (["serve", "--backend", "tpu"], "backend must be speedkv or vllm"),
    ],
)
def test_bad_backend_is_one_sentence(args, message, monkeypatch, capsys):
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_backend_vllm_without_vllm_names_the_make_target(command, monkeypatch, capsys):
    code, _, err = run_cli([*command, "--backend", "vllm"], monkeypatch, capsys)
    assert code == 2 and "make vllm-venv" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("layers", "lcut", "groups", "padded"),
    [
        (30, 22, (8, 3, 1), 2),  # 22 lower layers in groups of 8: one slot of two is empty
        (30, 24, (6, 4, 1), 0),
        (30, 15, (15, 1, 1), 0),
        (30, 26, (4, 7, 1), 2),
        (24, 18, (6, 3, 1), 0),
        (25, 14, (14, 1, 1), 3),  # 11 upper within 1.5x of 14: one group each, padded to 14
    ],
)
def test_kv_groups_follow_vllms_grouping(layers, lcut, groups, padded):
    from speedkv.vllm.settings import SpeedSettings, padding_free_lcut

    settings = SpeedSettings(lcut, anchors=1, deep=1)
    assert settings.kv_groups(layers) == groups
    assert settings.padded_layers(layers) == padded
    assert settings.padded_layers(layers) == 0 or padding_free_lcut(layers) != lcut
    assert SpeedSettings(lcut, 1, 1, compact_kv=False).kv_groups(layers) == (layers, 1, 0)


def test_vllm_cpu_defaults_a_small_pool_and_no_aot_compile_step(monkeypatch):
    from speedkv.vllm.offline import cpu_engine_defaults

    for name in ("VLLM_USE_AOT_COMPILE", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu_engine_defaults(1)  # vLLM's CUDA build keeps its own choice of compile cache
    assert "VLLM_USE_AOT_COMPILE" not in os.environ
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_engine_defaults(4)
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"  # set already: kept
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # the user's choice stands
    cpu_engine_defaults(1)
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_a_folder_named_vllm_on_the_path_is_not_a_vllm(tmp_path, monkeypatch):
    from speedkv.vllm.versions import refusal, vllm_version

    (tmp_path / "vllm").mkdir()  # as benchmarks/vllm/ is, once benchmarks/ is on sys.path
    monkeypatch.syspath_prepend(str(tmp_path))
    assert vllm_version() is None and refusal() is None
