"""Each method's selection logic on small hand-computed cases: scores, pooling, top-k,
forced windows, sorted indices, position ids."""

import math

import pytest
import torch

from speedkv.core.cache import LayerKV
from speedkv.core.policy import PromptInfo
from speedkv.core.registry import make_policy
from speedkv.errors import UserError
from speedkv.hf.backbone import ModelShape
from speedkv.methods.scoring import (
    attention_probs,
    budget,
    group_heads,
    pool1d,
    scaled_layer,
    top_plus_window,
    window_scores,
)

from conftest import random_prompt

SHAPE = ModelShape("llama", 4, 8, 2, 1, 4, 16, 50, 256)  # 2 query heads share 1 KV head


class View:
    """A finished layer as a policy sees it, built by hand."""

    def __init__(self, keys, q, q_pos, layer=0):
        heads, n, dim = keys.shape
        self.kv = LayerKV(heads, n + 4, dim, torch.float32, "cpu")
        self.kv.extend(keys, keys.clone(), torch.arange(n))
        self.layer, self.q_pos = layer, torch.arange(n)
        self._q = (q, q_pos)

    def queries(self):
        return self._q


def test_budget_ratio_or_count():
    assert budget(0.25, 80) == 20 and budget(1, 80) == 80 and budget(30, 80) == 30
    assert budget(500, 80) == 80
    for bad in (0, -1, 1.5):
        with pytest.raises(UserError):
            budget(bad, 80)


def test_scaled_layer_indices():
    assert scaled_layer(15, 30) == 14 and scaled_layer(13, 30) == 12 and scaled_layer(15, 32) == 15


def test_pooling_by_hand():
    x = torch.tensor([[0.0, 3.0, 0.0, 0.0, 6.0]])
    assert pool1d(x, 3, "max").tolist() == [[3.0, 3.0, 3.0, 6.0, 6.0]]
    # average with zero padding counted, as torch (and the references) do
    assert pool1d(x, 3, "avg")[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 2.0, 2.0])


def test_top_plus_window_keeps_window_and_sorts():
    scores = torch.tensor([[0.1, 0.9, 0.2, 0.8, 0.3]])  # entries 0..4 precede a window 5..6
    assert top_plus_window(scores, keep=4, n=7).tolist() == [[1, 3, 5, 6]]
    assert top_plus_window(scores, keep=2, n=7).tolist() == [[5, 6]]
    assert top_plus_window(scores, keep=9, n=7).tolist() == [[0, 1, 2, 3, 4, 5, 6]]


def test_group_heads_sums_query_heads_of_each_kv_head():
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    assert group_heads(s, 2).tolist() == [[4.0, 6.0], [12.0, 14.0]]


def test_attention_probs_are_causal_by_position():
    k = torch.zeros(1, 3, 4)
    q = torch.zeros(1, 2, 4)
    probs = attention_probs(q, torch.tensor([0, 2]), k, torch.tensor([0, 1, 2]))
    assert probs[0].tolist() == [[1.0, 0.0, 0.0], [pytest.approx(1 / 3)] * 3]


def one_hot_keys(n, dim=4):
    keys = torch.zeros(1, n, dim)
    for i in range(n):
        keys[0, i, i % dim] = 1.0
    return keys


def test_window_scores_by_hand():
    # 6 keys; the 2 window queries both look only along dim 1 -> tokens 1 and 5 (dim 1)
    keys = one_hot_keys(6)
    q = torch.zeros(2, 2, 4)
    q[:, :, 1] = 50.0
    scores = window_scores(q, torch.tensor([4, 5]), keys, torch.arange(6), 2, 1, "max")
    # the query at 4 sees only token 1 along dim 1 (1.0); the one at 5 splits 1 and 5 (0.5)
    assert scores.shape == (2, 4)
    assert scores[0].tolist() == pytest.approx([0.0, 1.5, 0.0, 0.0], abs=1e-6)


def test_snapkv_per_query_head_and_grouped_selection():
    keys = one_hot_keys(10)
    q = torch.zeros(2, 2, 4)
    q[0, :, 2] = 40.0  # head 0 looks at dim 2: tokens 2, 6
    q[1, :, 3] = 40.0  # head 1 looks at dim 3: tokens 3, 7
    view = View(keys, q, torch.tensor([8, 9]))
    per_head = make_policy("snapkv:retain=4,window=2,kernel=1", SHAPE).kept(0, view)
    assert per_head.tolist() == [[2, 6, 8, 9], [3, 7, 8, 9]]
    grouped = make_policy("snapkv:retain=4,window=2,kernel=1,gqa=true", SHAPE).kept(0, view)
    assert grouped.shape == (1, 4) and grouped[0, 2:].tolist() == [8, 9]
    assert set(grouped[0, :2].tolist()) <= {2, 3, 6, 7}


def test_fastkv_tsp_selection_and_retention():
    keys = one_hot_keys(12)
    q = torch.zeros(2, 2, 4)
    q[:, :, 1] = 40.0  # both heads look at dim 1: tokens 1, 5, 9
    view = View(keys, q, torch.tensor([10, 11]), layer=1)
    policy = make_policy("fastkv:tsp_layer=1,tsp_rate=0.5,retain=0.5,window=2,kernel=1", SHAPE)
    policy.begin(PromptInfo(torch.zeros(12, dtype=torch.long)))
    policy.observe(1, view)
    selected = policy.computed(2, None)
    # keep int(12 * 0.5) = 6: the window (10, 11) and the four best earlier tokens
    assert selected.sum() == 6 and selected[[1, 5, 9, 10, 11]].all()
    kept = policy.kept(1, view)
    assert kept.shape == (1, 6) and kept[0].tolist() == sorted(kept[0].tolist())
    assert {1, 5, 9, 10, 11} <= set(kept[0].tolist())
    # after TSP a layer holding the 6 survivors retains retain / tsp_rate = all of them
    assert policy.retained(2, 6) == 6


def test_streamingllm_keeps_sinks_and_recent_and_evicts_oldest():
    policy = make_policy("streamingllm:sink=2,window=3", SHAPE)
    policy.begin(PromptInfo(torch.zeros(10, dtype=torch.long)))
    view = View(one_hot_keys(10), torch.zeros(2, 1, 4), torch.tensor([9]))
    keep = policy.kept(0, view)
    assert keep.nonzero()[:, 0].tolist() == [0, 1, 7, 8, 9]
    view.kv.keep(keep.nonzero()[:, 0])
    view.kv.write_next(torch.ones(1, 1, 4), torch.ones(1, 1, 4), 10)
    view.kv.commit()
    policy.after_decode(0, torch.zeros(2, 1, 4), view.kv)
    assert sorted(view.kv.positions()[0].tolist()) == [0, 1, 8, 9, 10]  # 7, the oldest, went


def test_h2o_heavy_hitters_and_decode_eviction():
    policy = make_policy("h2o:heavy=2,recent=2", SHAPE)
    policy.begin(PromptInfo(torch.zeros(8, dtype=torch.long)))
    keys = one_hot_keys(8)
    q = torch.zeros(2, 8, 4)
    q[:, :, 3] = 30.0  # every query looks along dim 3: tokens 3 and 7
    view = View(keys, q, torch.arange(8))
    index = policy.kept(0, view)
    # heavy: token 3 (seen by queries 3..7) and token 0 (each early query's only option)
    assert index.tolist() == [[0, 3, 6, 7]]
    view.kv.keep(index[0])
    view.kv.write_next(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), 8)
    view.kv.commit()
    policy.after_decode(0, torch.zeros(2, 1, 4), view.kv)  # uniform attention this step
    # the lowest accumulated score outside the recent window (7, 8) goes: token 6
    assert sorted(view.kv.positions()[0].tolist()) == [0, 3, 7, 8]


def test_pyramidinfer_schedule_and_choice():
    shape = ModelShape("llama", 4, 8, 2, 1, 4, 16, 50, 256)
    policy = make_policy("pyramidinfer:recent=2,decay=0.5,min_context=1,sink=1", shape)
    assert policy.ratio(0) == 1.0
    assert policy.ratio(2) == pytest.approx(0.5 * (math.cos(math.pi / 2) + 1) / 2 + 0.5)
    policy.begin(PromptInfo(torch.zeros(10, dtype=torch.long)))
    q = torch.zeros(2, 2, 4)
    q[:, :, 2] = 40.0  # recent queries look at dim 2: tokens 2 and 6
    policy.observe(0, View(one_hot_keys(10), q, torch.tensor([8, 9])))
    selected = policy.computed(1, None)
    keep = int(8 * policy.ratio(1))  # context of 8 shrinks by ratio(1)
    assert selected[:8].sum() == keep and selected[8:].all()  # recent rows always stay
    assert selected[[0, 2, 6]].all()  # the sink and the attended tokens


def test_gemfilter_renumbers_positions(monkeypatch):
    policy = make_policy("gemfilter:retain=3,filter_layer=1", SHAPE)
    scores = torch.tensor([0.0, 5.0, 1.0, 4.0, 0.5, 3.0])
    monkeypatch.setattr(policy, "token_scores", lambda ids, engine: scores)
    sel = policy.select_prompt(PromptInfo(torch.arange(6)), engine=None)
    assert sel.indices.tolist() == [1, 3, 5]
    assert sel.positions.tolist() == [0, 1, 2] and sel.next_position == 3


def test_specprefill_chunk_selection_keeps_original_positions(monkeypatch):
    policy = make_policy("specprefill:keep=0.4,chunk=3", SHAPE)
    # 10 tokens -> chunks [0-2] [3-5] [6-8] [9]; means 1, 5, 2, 4; keep ceil(4 * 0.4) = 2
    scores = torch.tensor([1.0, 1, 1, 5, 5, 5, 2, 2, 2, 4])
    monkeypatch.setattr(policy, "token_scores", lambda ids, engine: scores)
    sel = policy.select_prompt(PromptInfo(torch.arange(10)), engine=None)
    assert sel.indices.tolist() == [3, 4, 5, 9]
    assert sel.positions.tolist() == [3, 4, 5, 9] and sel.next_position == 10
    forced = make_policy("specprefill:keep=0.25,chunk=3,force_last=2", SHAPE)
    monkeypatch.setattr(forced, "token_scores", lambda ids, engine: scores)
    sel = forced.select_prompt(PromptInfo(torch.arange(10)), engine=None)
    assert sel.indices.tolist() == [3, 4, 5, 8, 9]


def test_selected_positions_reach_the_cache(tiny, tiny_engine, monkeypatch):
    """SpecPrefill prefills at original positions, GemFilter at new ones 0..k-1."""
    from speedkv.methods.gemfilter import GemFilter
    from speedkv.methods.specprefill import SpecPrefill

    ids = random_prompt(40)
    scores = torch.arange(40, dtype=torch.float32)  # later tokens score higher
    monkeypatch.setattr(SpecPrefill, "token_scores", lambda self, ids, engine: scores)
    monkeypatch.setattr(GemFilter, "token_scores", lambda self, ids, engine: scores)
    spec = tiny_engine.prefill_ids(ids, make_policy("specprefill:keep=0.25,chunk=4", tiny.shape))
    assert spec.cache.layers[0].positions()[0].tolist() == list(range(28, 40))
    assert spec.next_position == 40
    gem = tiny_engine.prefill_ids(
        ids, make_policy("gemfilter:retain=10,filter_layer=1", tiny.shape)
    )
    assert gem.cache.layers[3].positions()[0].tolist() == list(range(10))
    assert gem.next_position == 10


def test_pop_and_swiftkv_synthesise_kv_from_the_frozen_residual(tiny, tiny_engine):
    """Upper-layer K/V of a skipped prompt token = that layer's (POP) or layer k's (SwiftKV)
    norm and the upper layer's projections applied to the residual entering the cut."""
    bb = tiny.backbone
    ids = torch.tensor(random_prompt(20))
    pos = torch.arange(20)
    h = bb.embed(ids)[None]
    mask = (pos[None, :] <= pos[:, None])[None, None]
    for layer in range(3):
        h = bb.hf_layer(layer, h, mask, pos)
    cos, sin = bb.rope(pos)
    pop = tiny_engine.prefill_ids(ids, make_policy("pop:lcut=3", tiny.shape)).cache
    swift = tiny_engine.prefill_ids(ids, make_policy("swiftkv:k=3", tiny.shape)).cache
    for layer in (3, 5):
        k_pop, _ = bb.kv(layer, bb.input_norm(layer, h[0]), cos, sin)
        k_swift, _ = bb.kv(layer, bb.input_norm(3, h[0]), cos, sin)
        assert torch.allclose(pop.layers[layer].keys()[:, :19], k_pop[:, :19], atol=1e-4)
        assert torch.allclose(swift.layers[layer].keys(), k_swift, atol=1e-4)  # last one too


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fastkv:tsp_rate=0", "tsp_rate must be"),
        ("fastkv:retain=1.5", "retain above 1 is a token count"),
        ("fastkv:tsp_layer=4", "tsp_layer must be between 0 and 3"),
        ("snapkv:retain=-0.2", "retain must be"),
        ("snapkv:pool=median", "pool must be"),
        ("specprefill:keep=2", "keep is a fraction"),
        ("specprefill:speculator=self:9", "speculator self:K"),
        ("gemfilter:filter_layer=-1", "filter_layer must be between"),
        ("pop:lcut=5", "lcut must be between 0 and 4"),
        ("swiftkv:k=7", "k must be between 0 and 4"),
        ("swiftkv:acrosskv=0", "acrosskv must be"),
        ("h2o:heavy=0", "heavy must be"),
        ("streamingllm:window=0", "window must be"),
        ("pyramidinfer:decay=1.5", "decay must be"),
        ("h2o:budget=3", "has no option 'budget'"),
    ],
)
def test_bad_option_values(spec, message):
    with pytest.raises(UserError, match=message):
        make_policy(spec, SHAPE)
