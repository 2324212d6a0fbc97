"""Sliding-window models through the vLLM plugin: Mistral with a window on every layer, and
Gemma 3's local layers interleaved with global ones. A small random checkpoint of each, SPEED
against speedkv's own engine and the dense reference on the same weights (float32, greedy).

The rule (speedkv.methods.speed.SpeedRule.deep_for): a prompt whose anchors would still be
inside its first deep token's window runs wholly at full depth; a longer one's deep rows see
no anchor in a windowed layer. The plugin lays a windowed upper group's rows out in an anchor
segment and a deep segment (speedkv.vllm.compact.segmented), so vLLM's own kernel window over
compact indices is the window over positions. Prompts here fall on both sides of that bound,
whole and in chunks (a 64-token step budget), with windowed and global upper groups (Gemma 3's
layers 4 and 5 at lcut 4)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

from speedkv import Engine, Request, SamplingParams, make_policy
from speedkv.errors import Unsupported
from speedkv.hf.loading import wrap_model
from speedkv.methods.speed import SpeedRule
from speedkv.vllm.args import engine_args

from conftest import LONG_TESTS, save_tiny_checkpoint, vllm_engine
from test_vllm_prefix_cache import BLOCK, Replay, Served, check, serve

WINDOW = 48
LAYERS = 6
VOCAB = 512
NEW = 8
BUDGET = 64
ANCHORS, DEEP = 2, 3
METHOD = f"speed:lcut=4,anchors=sink:{ANCHORS},deep={DEEP}"
# whole-depth below WINDOW + ANCHORS - 1 + DEEP = 52 tokens; 60 and up run SPEED, from 129 in
# chunks; 300 spans six windows
LENGTHS = [3, 40, 52, 60, 129, 300]
LOCAL, GLOBAL = "sliding_attention", "full_attention"

FAMILIES = {
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": WINDOW},
                "SpeedMistralForCausalLM"),
    # head size 32 (vLLM's CPU kernel), an attention scale that is not 1/sqrt(head size)
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM,
                    {"sliding_window": WINDOW, "layer_types": [LOCAL, LOCAL, GLOBAL] * 2,
                     "head_dim": 32, "query_pre_attn_scalar": 24},
                    "SpeedGemma3ForCausalLM"),
}  # fmt: skip


def tiny_checkpoint(family: str, directory) -> tuple[object, str]:
    """A random 6-layer model of the family (4 query, 2 KV heads of 32), its weights scaled so
    greedy choices are decisive, saved as an HF directory; and its SPEED architecture name."""
    config_cls, model_cls, options, arch = FAMILIES[family]
    model = save_tiny_checkpoint(config_cls, model_cls, directory, LAYERS, VOCAB, **options)
    return model, arch


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tiny-windowed-{request.param}")
    model, arch = tiny_checkpoint(request.param, directory)
    return directory, model, arch


def random_ids(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def expected_upper_rows(prompts: list[list[int]]) -> int:
    """Rows the upper layers compute under the window rule: a short prompt whole, a longer
    one's anchors and deep suffix; then each generated token fed back."""
    rule = SpeedRule(4, ANCHORS, DEEP, window=WINDOW)
    rows = 0
    for ids in prompts:
        deep = rule.deep_for(len(ids), DEEP)
        rows += len(ids) if deep == len(ids) else ANCHORS + deep
    return rows + len(prompts) * (NEW - 1)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_speed_on_a_windowed_model_equals_the_engine_and_the_dense_reference(checkpoint, tp):
    """With 2 tensor-parallel ranks each holds 2 query heads and 1 KV head; the segments are
    per request, the same on every rank. Mistral's two ranks run in `make test-long`."""
    from vllm import SamplingParams as VllmSampling

    directory, model, arch = checkpoint
    if tp > 1 and arch == "SpeedMistralForCausalLM" and not LONG_TESTS:
        pytest.skip("SPEEDKV_LONG_TESTS=1 (make test-long) runs it")
    args = engine_args(METHOD, directory)
    assert args["hf_overrides"]["architectures"] == [arch]
    assert "enable_prefix_caching" not in args  # vLLM's default: on
    prompts = random_ids(LENGTHS, seed=1)
    sampling = VllmSampling(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0,
                            detokenize=False)  # fmt: skip
    with vllm_engine(directory, **args, skip_tokenizer_init=True,
                     max_num_batched_tokens=BUDGET, tensor_parallel_size=tp) as llm:  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                               use_tqdm=False)  # fmt: skip
        rows = llm.collective_rpc(lambda worker: worker.model_runner.model.upper_rows)
    served = [
        Served(list(o.prompt_token_ids), list(o.outputs[0].token_ids),
               [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
               o.num_cached_tokens)
        for o in outputs
    ]  # fmt: skip
    assert rows == [expected_upper_rows(prompts)] * tp
    check(Replay(wrap_model(model), METHOD, new=NEW), served)


def test_prefix_caching_reuses_prefixes_whose_upper_rows_are_the_anchors(checkpoint):
    """Prefix caching on a windowed model. vLLM's sliding-window groups keep the blocks for a
    hit at a prompt's last block boundary only. A 386-token prompt (deep from 383) leaves its
    record at 384, where the upper layers hold row 383 besides the anchors. A prompt that
    continues it by 10 tokens reuses nothing: its deep rows start at 393, so row 383 is inside
    their window, but the windowed layout keeps reused rows in the anchors' block, which a deep
    row never reads (taking that hit gives other tokens: checked by hand). A 320-token question
    on the same document leaves its record at 256, where the upper layers hold the anchors
    alone: the next question reuses it. Each answer equals speedkv's engine continuing the same
    prefix (`Replay`) and the dense reference with that depth history."""
    directory, model, arch = checkpoint
    doc, ask, more, q1, q2 = random_ids([300, 86, 10, 20, 80], seed=2)
    steps = [
        lambda served: doc + ask,  # 0: fresh; its record at 384 holds a deep row
        lambda served: doc + ask + more,  # 1: the same prompt, continued by 10 tokens
        lambda served: doc + q1,  # 2: a question; its record at 256 holds the anchors
        lambda served: doc + q2,  # 3: another question on the document
    ]
    served = serve(directory, METHOD, steps, new=NEW, skip_tokenizer_init=True)
    assert [s.hit for s in served] == [0, 0, 0, 2 * BLOCK]
    check(Replay(wrap_model(model), METHOD, new=NEW), served)


@pytest.mark.parametrize("method", [METHOD, "full"])
def test_kv_bytes_are_the_blocks_vllms_pool_holds(checkpoint, method):
    """`speedkv generate/bench --backend vllm`'s KV bytes on a windowed model, against the
    blocks vLLM's own managers hold at every decode step (32-token blocks, three prompts past
    the window): the groups vLLM makes of each kind of layer (windowed or not, below the cut or
    above it) are `SpeedSettings.group_layers`, and a windowed lower group has freed the blocks
    behind its window. The rows each layer holds are speedkv's engine's."""
    from vllm import SamplingParams as VllmSampling

    from speedkv.vllm.offline import VllmEngine
    from speedkv.vllm.settings import SpeedSettings

    directory, model, _ = checkpoint
    prompts = random_ids([60, 129, 300], seed=3)
    sampling = VllmSampling(temperature=0.0, max_tokens=NEW, ignore_eos=True, detokenize=False)
    model = wrap_model(model)
    engine = Engine(model)
    with VllmEngine.open(directory, method, dtype="float32", seed=0, enforce_eager=True,
                         skip_tokenizer_init=True, block_size=32) as vllm:  # fmt: skip
        core = vllm.llm.llm_engine.engine_core.engine_core
        config = core.scheduler.kv_cache_config
        layers, windows = vllm.shape.num_layers, vllm.shape.windows
        groups = [sorted(int(n.split(".")[2]) for n in g.layer_names)
                  for g in config.kv_cache_groups]  # fmt: skip
        settings = vllm.speed or SpeedSettings(layers, 0, 0, compact_kv=False)
        assert groups == settings.group_layers(layers, windows)
        # what one block of the pool costs (every group's tensor spans the same blocks)
        block = config.kv_cache_tensors[0].size // config.num_blocks
        managers = core.scheduler.kv_cache_manager.coordinator.single_type_managers
        decode_steps = 0
        for i, ids in enumerate(prompts):
            vllm.llm.llm_engine.add_request(str(i), {"prompt_token_ids": ids}, sampling)
            while vllm.llm.llm_engine.has_unfinished_requests():
                vllm.llm.llm_engine.step()
                for request in core.scheduler.running:
                    tokens = request.num_computed_tokens
                    if tokens <= len(ids):
                        continue  # a prefill step: the window manager frees after a whole step
                    held = sum(not b.is_null for m in managers
                               for b in m.req_to_blocks[request.request_id])  # fmt: skip
                    assert vllm.block_bytes(tokens, len(ids)) == held * block
                    decode_steps += 1
            done = engine.generate([Request(ids, make_policy(method, model.shape),
                                            SamplingParams(max_new_tokens=2))])[0]  # fmt: skip
            assert vllm.layer_lengths(len(ids)) == done.layer_lengths
        # every decode step but the last, after which the request is no longer running
        assert decode_steps == len(prompts) * (NEW - 2)


def test_stock_blocks_are_refused_on_a_windowed_model(tmp_path):
    """Stock upper-layer blocks, whose window manager would free the blocks holding compact
    rows: refused with one sentence at `LLM(...)`."""
    from vllm import LLM

    _, arch = tiny_checkpoint("mistral", tmp_path)
    overrides = {"architectures": [arch], "speedkv_lcut": 4, "speedkv_anchors": ANCHORS,
                 "speedkv_deep": DEEP, "speedkv_compact_kv": False}  # fmt: skip
    with pytest.raises(Unsupported, match="own KV blocks only") as refused:
        LLM(model=str(tmp_path), hf_overrides=overrides, dtype="float32",
            skip_tokenizer_init=True, enforce_eager=True)  # fmt: skip
    assert "\n" not in str(refused.value)
