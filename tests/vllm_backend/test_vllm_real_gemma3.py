"""The embedded Gemma 3 270M (15 local layers with a 512-token window, 3 global) through the
vLLM plugin, where it is installed (`speedkv models --install gemma3-270m`; not part of `make
test`'s downloads): on a 751-token prompt, past the window, SPEED at 13 of 18 layers gives
speedkv's own engine's tokens (float32, greedy), and its KV bytes count the blocks vLLM
holds. Its upper groups are windowed (segmented) and global at once (speedkv.vllm.compact)."""

import math
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
        size, per = vllm.block_size, vllm.kv_bytes_per_token_layer
    assert record["output_ids"] == done.output_ids
    assert record["layer_lengths"] == done.layer_lengths
    # 18 KV cache groups of one layer (the upper global kind holds one): a block costs one
    # layer slot. Each of the 11 lower local layers holds the blocks its 512-token window
    # has not left, the 2 lower global ones every block, the 4 upper local ones the anchor's
    # block and one for the deep rows, the upper global one a block for its 3 rows.
    tokens = len(ids) + 1
    lower = 11 * (math.ceil(tokens / size) - (tokens - 512) // size) + 2 * math.ceil(tokens / size)
    assert record["kv_bytes"] == (lower + 4 * 2 + 1) * size * per
