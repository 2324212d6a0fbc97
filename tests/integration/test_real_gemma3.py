"""The embedded Gemma 3 270M (18 layers: 15 local with a 512-token window, 3 global; tied
embeddings) in float32, where it is installed (`speedkv models --install gemma3-270m`; not part
of `make test`'s downloads): on a prompt longer than the window, full attention is transformers'
greedy, and SPEED at 75 % depth (13 of 18 layers) is the dense reference and holds the KV it
says it does (its local layers keep only what their window reaches)."""

import pytest

from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams

from helpers import check_equals_dense, check_equals_hf_generate, document_prompt_ids

pytestmark = pytest.mark.real_model

WINDOW = 512


@pytest.fixture(scope="module")
def engine():
    from speedkv.hf.loading import EMBEDDED, load_model

    if EMBEDDED["gemma3-270m"].part_paths() is None:
        pytest.skip("the embedded Gemma 3 270M is not installed (speedkv models --install)")
    model = load_model("gemma3-270m", dtype="float32", device="cpu", progress=False)
    shape = model.shape
    assert (shape.model_type, shape.num_layers, shape.num_heads, shape.num_kv_heads) == (
        "gemma3_text",
        18,
        4,
        1,
    )
    assert shape.windows == ((WINDOW,) * 5 + (None,)) * 3
    assert shape.starts_with_bos
    return Engine(model, chunk_size=128)


@pytest.fixture(scope="module")
def prompt_ids(engine):
    ids = document_prompt_ids(engine.model.tokenizer, 700, "What is the text above about?")
    assert len(ids) > WINDOW + 100  # the local layers drop rows
    return ids


def test_prompts_begin_with_bos_as_the_gguf_says(engine):
    """Gemma 3's GGUF sets add_bos_token (transformers' loader drops it; speedkv's conversion
    keeps it), and a benchmark prompt of a model without a chat template is raw text after it."""
    from speedkv.prompts.builders import exact_chat_prompt

    tokenizer = engine.model.tokenizer
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id
    ids = exact_chat_prompt(tokenizer, 300)
    assert len(ids) == 300 and ids[0] == tokenizer.bos_token_id and ids.count(ids[0]) == 1


def test_full_equals_hf_generate_past_the_window(engine, prompt_ids):
    check_equals_hf_generate(engine, prompt_ids, ["full"], steps=8)


def test_speed_at_three_quarters_depth_equals_the_dense_reference(engine, prompt_ids):
    spec = "speed:lcut=13,anchors=bos,deep=1"
    check_equals_dense(engine, prompt_ids, spec, steps=4, atol=1e-3)
    n = len(prompt_ids)
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    speed, full = (
        engine.generate([Request(prompt_ids, make_policy(s, engine.shape), sampling)])[0]
        for s in (spec, "full")
    )
    # local layers keep the 511 rows the first new token sees; upper global ones BoS and the
    # last token, upper local ones the last token (BoS is outside their window)
    windows = engine.shape.windows
    lower = [n if w is None else w - 1 for w in windows[:13]]
    upper = [2 if w is None else 1 for w in windows[13:]]
    assert speed.layer_lengths == lower + upper
    assert full.layer_lengths == [n if w is None else w - 1 for w in windows]
    assert speed.kv_bytes / full.kv_bytes == pytest.approx(
        sum(lower + upper) / sum(full.layer_lengths)
    )
