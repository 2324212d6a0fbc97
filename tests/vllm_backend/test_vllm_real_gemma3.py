"""The embedded Gemma 3 270M (15 local layers with a 512-token window, 3 global) through the
vLLM plugin, where it is installed (`speedkv models --install gemma3-270m`; not part of `make
test`'s downloads): on a 751-token prompt, past the window, SPEED at 13 of 18 layers gives
speedkv's own engine's tokens (float32, greedy). Its upper groups are windowed (segmented)
and global at once (speedkv.vllm.compact)."""

from pathlib import Path

import pytest

from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams

pytestmark = pytest.mark.real_model

METHOD = "speed:lcut=13,deep=1"
NEW = 16


def test_speed_through_vllm_equals_the_engine_past_the_window():
    from speedkv.hf.loading import EMBEDDED, load_model, model_directory
    from speedkv.vllm.offline import VllmEngine

    if EMBEDDED["gemma3-270m"].part_paths() is None:
        pytest.skip("the embedded Gemma 3 270M is not installed (speedkv models --install)")
    model = load_model("gemma3-270m", dtype="float32", device="cpu", progress=False)
    # Python's own source: text that ships with the interpreter
    text = Path(__import__("textwrap").__file__).read_text()[:3000]
    ids = model.tokenizer(text)["input_ids"]
    # the GGUF's add_bos_token holds: prompts begin with <bos>, SPEED's default anchor
    assert ids[0] == model.tokenizer.bos_token_id and model.shape.starts_with_bos
    assert len(ids) > 512 + 1 + 1  # past the rule's bound: SPEED, not whole-depth
    sampling = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engine = Engine(model)
    done = engine.generate([Request(ids, make_policy(METHOD, model.shape), sampling)])[0]
    assert done.layer_lengths[13:] == [1, 1, 1, 1, 2]  # local: the deep row; global: + BoS
    with VllmEngine.open(model_directory("gemma3-270m"), METHOD, dtype="float32") as vllm:
        record = vllm.generate([ids], sampling)[0]
    assert record["output_ids"] == done.output_ids
    assert record["kv_bytes"] is None  # not modelled for windowed layers (offline.py)
