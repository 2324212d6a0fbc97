"""Gemma 3's text model (`gemma3_text`) in speedkv's own engine, against transformers: what
sets it apart from the Llama-shaped families -- embeddings scaled by sqrt(hidden_size), RMSNorms
that scale by 1 + weight, per-head q/k norms, norms after attention and around the MLP, a
GELU-tanh MLP, the attention scale query_pre_attn_scalar**-0.5, a rotary base per layer type,
local layers interleaved with global ones, a final logit soft cap -- layer by layer and end to
end. The sliding-window suite (test_sliding_window.py) and the engine and method equivalence
files run the same family on their own prompts."""

from __future__ import annotations

import json

import pytest
import torch

from speedkv.analysis.dense import speed_dense_forward
from speedkv.core.engine import Engine
from speedkv.core.registry import make_policy
from speedkv.errors import UserError
from speedkv.hf.backbone import check_supported, decode_dims, in_window
from speedkv.hf.loading import LoadedModel, load_model
from speedkv.kernels.attention import prefill_attention

from conftest import TINY_SETTINGS, random_prompt, tiny_model
from helpers import check_equals_hf_generate, greedy_with_logits

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, no contention

N, NEW = 100, 8  # prompt tokens: six 16-token windows
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def build(seed: int = 0, **config) -> LoadedModel:
    """conftest's tiny Gemma 3: 6 layers, local-local-global twice, a 16-token window."""
    return tiny_model("gemma3_text", seed, **config)


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    return build()


@pytest.fixture(scope="module")
def engine(gemma) -> Engine:
    return Engine(gemma, chunk_size=32)  # prompts span several chunks and several windows


def test_the_config_is_read_as_transformers_reads_it(gemma):
    config, bb = gemma.hf_model.config, gemma.backbone
    assert config.layer_types == [LOCAL, LOCAL, GLOBAL] * 2
    assert gemma.shape.windows == (16, 16, None, 16, 16, None)
    assert gemma.shape.head_dim == 16 and config.query_pre_attn_scalar == 24
    assert bb.scaling == 24**-0.5 != gemma.shape.head_dim**-0.5
    # each layer type its own rotary base (transformers' defaults), both in one table
    thetas = {kind: p["rope_theta"] for kind, p in config.rope_parameters.items()}
    assert thetas == {LOCAL: 10_000.0, GLOBAL: 1_000_000.0}
    cos, sin = bb.rope(torch.arange(5))
    assert cos.shape == sin.shape == (5, 2 * gemma.shape.head_dim)
    assert config.hidden_activation == "gelu_pytorch_tanh"
    # the embedding is scaled by sqrt(hidden_size) rounded to the model's dtype (8.0 here
    # exactly; sqrt(48) is 6.9375 in bfloat16)
    ids = torch.tensor([3, 7])
    assert torch.equal(bb.embed(ids), gemma.hf_model.model.embed_tokens.weight[ids] * 8.0)
    half = build(hidden_size=48, num_attention_heads=4).hf_model.to(torch.bfloat16)
    embed = half.model.embed_tokens
    want = embed.weight[ids] * torch.tensor(48**0.5, dtype=torch.bfloat16)
    assert torch.equal(embed(ids), want)


def test_each_layer_in_parts_is_transformers_layer(gemma):
    """The engine's pieces of every layer -- input norm, q/k/v with per-head norms, the layer
    type's rotary table and the model's attention scale, attention in the layer's window, the
    output projection and its norm, the MLP between its two norms -- give transformers' own
    decoder layer's output, local and global layers alike."""
    bb, n = gemma.backbone, 40
    h = torch.randn(n, gemma.shape.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(n)
    cos, sin = bb.rope(pos)
    inner = gemma.hf_model.model
    for layer, kind in enumerate(gemma.hf_model.config.layer_types):
        window = gemma.shape.window(layer)
        assert (window is None) == (kind == GLOBAL)
        mask = (pos[None, :] <= pos[:, None]) & in_window(window, pos, pos)
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        with torch.inference_mode():
            q, k, v = bb.before_attention(layer, h, cos, sin, prefill=True)
            ours = bb.after_attention(layer, h, prefill_attention(q, k, v, mask), prefill=True)
            # transformers' layer with its layer type's rotary table, as its model calls it
            theirs = inner.layers[layer](
                h[None],
                attention_mask=additive[None, None],
                position_ids=pos[None],
                position_embeddings=inner.rotary_emb(h[None], pos[None], kind),
            )[0]
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (layer, (ours - theirs).abs().max())


LINEAR_GLOBAL_ROPE = {  # Gemma 3 4B and larger: linear scaling on the global layers only
    "rope_parameters": {
        GLOBAL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        LOCAL: {"rope_type": "default", "rope_theta": 10_000.0},
    }
}


@pytest.mark.parametrize(
    "config",
    [{}, {"tie_word_embeddings": True}, LINEAR_GLOBAL_ROPE, {"final_logit_softcapping": 1.5}],
    ids=["tiny", "tied", "linear-rope", "softcap"],
)
def test_full_attention_equals_hf_generate(config):
    """`full`, and SPEED at lcut = L, give transformers' greedy tokens on a prompt six windows
    long: as conftest builds it, with the tied embeddings the checkpoints have, with rope
    scaling on the global layers, and with a final logit soft cap."""
    model = build(**config)
    engine = Engine(model, chunk_size=32)
    L = model.shape.num_layers
    specs = ["full", f"speed:lcut={L},anchors=bos,deep=1", f"speed:lcut={L},anchors=none,deep=5"]
    check_equals_hf_generate(engine, random_prompt(N, seed=2), specs, NEW)


def test_the_final_soft_cap_is_transformers():
    """The engine's logits are transformers' soft-capped ones, which the cap changes."""
    ids = random_prompt(N, seed=3)

    def first_logits(model):
        policy = make_policy("full", model.shape)
        return Engine(model, chunk_size=32).prefill_ids(ids, policy).logits

    capped, plain = build(final_logit_softcapping=1.5), build()
    got = first_logits(capped)
    with torch.inference_mode():
        own = capped.hf_model(torch.tensor([ids])).logits[0, -1].float()
    assert torch.allclose(got, own, atol=1e-5, rtol=0), (got - own).abs().max()
    assert got.abs().max() < 1.5
    assert torch.allclose(got, 1.5 * torch.tanh(first_logits(plain) / 1.5), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "lcut, deep",
    [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (3, 24), (4, 40)],  # deep 24, 40: past the window
)
def test_speed_equals_the_dense_reference(gemma, engine, lcut, deep):
    """SPEED with a BoS anchor: every layer applies its window by absolute position, above the
    cut as below it (SpeedRule.visibility), so the anchor, 100 positions back, is outside every
    local layer's window and seen by the global layers only."""
    ids = random_prompt(N, seed=lcut + deep)
    policy = make_policy(f"speed:lcut={lcut},anchors=bos,deep={deep}", gemma.shape)
    tokens, logits, _ = greedy_with_logits(engine, ids, policy, steps=NEW)
    sequence = torch.tensor(ids + tokens[:-1])
    dense, positions = speed_dense_forward(gemma.backbone, sequence, N, lcut, 1, deep)
    dense = dense[positions >= N - 1]  # the rows that predict new tokens
    assert dense.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, dense, atol=1e-4, rtol=0), (logits - dense).abs().max()
    lengths = engine.prefill(ids, policy.spec()).cache.lengths()
    assert lengths == [N] * lcut + [1 + deep] * (gemma.shape.num_layers - lcut)


def test_the_native_layer_kernels_are_not_used_for_its_layers():
    """speedkv's fused layer functions and one-call decode layer compute the Llama-shaped
    layer; Gemma 3's layers run as the model's own modules, prepacked or not."""
    model = build()
    assert decode_dims(model.hf_model.config, model.shape) is None
    engine = Engine(model, prepack=True)
    bb = engine.backbone
    assert bb.decode_weights() == [None] * model.shape.num_layers
    assert not bb.layers_in_one_call(1)
    check_equals_hf_generate(engine, random_prompt(40, seed=4), ["full"], NEW)


@pytest.mark.parametrize(
    "option, says",
    [
        ({"attn_logit_softcapping": 50.0}, "caps attention logits"),
        ({"use_bidirectional_attention": True}, "attends bidirectionally"),
    ],
)
def test_what_the_engine_does_not_compute_is_refused_in_one_sentence(option, says, tmp_path):
    with pytest.raises(UserError, match=says):
        build(**option)
    # a checkpoint directory is refused from its config.json, before any weight is read
    config = build().hf_model.config.to_dict() | option
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=says):
        load_model(str(tmp_path), dtype="float32", device="cpu", progress=False)


def test_the_image_text_model_is_refused_with_what_runs_instead():
    with pytest.raises(UserError, match="image-text model; speedkv runs Gemma 3 text models"):
        check_supported("gemma3")


def test_the_tiny_settings_keep_the_family_distinct():
    """conftest's Gemma 3 is not a Llama in disguise: an attention scale other than
    1/sqrt(head_dim), and local layers on both sides of a global one."""
    settings = TINY_SETTINGS["gemma3_text"]
    assert settings["query_pre_attn_scalar"] != settings["head_dim"]
    assert {LOCAL, GLOBAL} == set(settings["layer_types"][:3])
