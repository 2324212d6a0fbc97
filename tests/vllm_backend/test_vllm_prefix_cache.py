"""vLLM's prefix caching under SPEED against speedkv's own reuse and the dense reference.

Requests go to one vLLM engine one after another, as a chat client or a RAG service sends them:
two questions on one document, a three-turn chat, then the document evicted by others and
asked about again. vLLM reports how many tokens each request took from its prefix cache; the
engine then replays the same request from its own cache of the same earlier request, cut at that
many tokens, and the dense reference computes it with the depth history spelled out: a reused
token keeps the depth it was first computed at (anchors, an earlier deep suffix, earlier
generated tokens), and the rule applies to the new tokens. All three give the same greedy tokens
(float32)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from speedkv import Engine, Request, SamplingParams, make_policy
from speedkv.analysis.dense import speed_hidden
from speedkv.core.prefix import CachedPrefix, PrefixCache, common_prefix
from speedkv.methods.speed import SpeedRule
from speedkv.prompts.builders import exact_chat_prompt
from speedkv.vllm.args import engine_args
from speedkv.vllm.settings import SpeedSettings

from conftest import LONG, run_vllm, vllm_engine

NEW = 6
LOGPROB_TOLERANCE = 2e-4  # float32: vLLM's CPU kernels against a dense torch forward (~2e-5)
DOC = 300  # tokens: two 128-token blocks and a part-filled third
BLOCK = 128  # vLLM's block size on the CPU


@dataclass
class Served:
    ids: list[int]
    tokens: list[int]
    logprobs: list[float]  # of each token, as vLLM computed it
    hit: int  # tokens vLLM took from its prefix cache


@dataclass
class Replay:
    """speedkv's engine replaying vLLM's requests from the same cached prefixes, and the depth
    history of every finished request (its prompt, and the tokens fed back).

    On a sliding-window model the engine's cache drops entries that leave the window as it
    generates, so it cannot be cut at an earlier token. There a hit that falls inside the
    earlier request's prompt (where vLLM's sliding-window groups keep their blocks) is replayed
    from that prompt prefilled again and not generated from: the same entries, none dropped."""

    model: object
    method: str
    new: int = NEW
    engine: Engine = field(init=False)
    histories: list[tuple[list[int], CachedPrefix, set[int], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine = self.new_engine()
        self.policy = make_policy(self.method, self.model.shape)
        self.rule = SpeedRule.of(self.policy)

    def run(self, ids: list[int], hit: int) -> tuple[list[int], set[int]]:
        """The engine's tokens for `ids` reusing `hit` tokens of the latest request that has
        them, and the positions of `ids` that run every layer."""
        prefix, depth = None, set(range(min(self.rule.anchors, len(ids))))
        if hit:
            fed, cache, earlier, prompt_len = next(
                h for h in reversed(self.histories) if common_prefix(h[0], ids) >= hit
            )
            shape = self.model.shape
            windows = [shape.window(layer) for layer in range(shape.num_layers)]
            if shape.windowed and not cache.cache.covers(windows, hit):
                assert hit <= prompt_len, "a windowed hit past the earlier prompt"
                cache = self.generate(fed[:prompt_len], None, new=1, engine=self.new_engine())[1]
            prefix = CachedPrefix(fed[:hit], cache.method, cache.cache)
            depth = {p for p in earlier if p < hit}
        prompt = len(ids)
        deep = self.rule.deep_for(prompt, self.rule.deep_tokens(None, None))
        depth |= set(range(max(hit, prompt - deep), prompt))
        tokens, kept = self.generate(ids, prefix, self.new, hit)
        fed = ids + tokens[:-1]
        self.histories.append((fed, kept, depth | set(range(prompt, len(fed))), prompt))
        return tokens, depth

    def new_engine(self) -> Engine:
        # a store that never serves a lookup: each request names its prefix, or starts fresh
        return Engine(self.model, prefix_cache=PrefixCache(2**32, min_tokens=10**9))

    def generate(self, ids: list[int], prefix: CachedPrefix | None, new: int, hit: int = 0,
                 engine: Engine | None = None) -> tuple[list[int], object]:  # fmt: skip
        """The engine's tokens and the cache entry it keeps for `ids` + all but the last."""
        engine = engine or self.engine
        sampling = SamplingParams(max_new_tokens=new, ignore_eos=True)
        done = engine.generate([Request(ids, self.policy, sampling, None, None, prefix)])[0]
        assert done.reused_tokens == hit
        fed = ids + done.output_ids[:-1]
        kept = next(e for e in engine.prefix_cache._entries.values() if e.ids == fed)
        return done.output_ids, kept

    def dense(self, ids: list[int], tokens: list[int], depth: set[int]) -> torch.Tensor:
        """The dense reference's log-probabilities [new tokens, vocabulary] where `tokens` are
        generated: `depth` and every generated token run every layer, the rest stops at lcut."""
        seq = ids + tokens[:-1]
        full = torch.zeros(len(seq), dtype=torch.bool)
        full[sorted(depth)] = True
        full[len(ids) - 1 :] = True
        backbone = self.model.backbone
        hidden, kept = speed_hidden(backbone, torch.tensor(seq), len(ids), self.rule,
                                    full_depth=full)  # fmt: skip
        return backbone.logits(hidden)[kept >= len(ids) - 1].log_softmax(-1)


def serve(directory, method: str, steps: list[Callable[[list[Served]], list[int]]],
          new: int = NEW, **llm_args) -> list[Served]:  # fmt: skip
    """Each step's prompt (built from the requests served before it), sent to one vLLM
    engine with prefix caching on, one after another."""
    from vllm import SamplingParams as VllmSampling

    args = {**engine_args(method, directory), "enable_prefix_caching": True, **llm_args}
    sampling = VllmSampling(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0,
                            detokenize=False)  # fmt: skip
    served: list[Served] = []
    with vllm_engine(directory, **args) as llm:
        for step in steps:
            ids = step(served)
            done = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
            out = done.outputs[0]
            chosen = [by_token[t].logprob for by_token, t in zip(out.logprobs, out.token_ids)]
            served.append(Served(ids, list(out.token_ids), chosen, done.num_cached_tokens))
    return served


def text(tokenizer, n: int, start: int) -> list[int]:
    """`n` tokens of a chat prompt without its BoS, to append to another."""
    return exact_chat_prompt(tokenizer, n + 1, start=start)[1:]


CASES = {
    # whole prompts, eviction included (a deep suffix of 4 is run chunked and on pipeline stages)
    "bos-deep1": ("speed:lcut=22,anchors=bos,deep=1", {}),
    "none-deep1": ("speed:lcut=22,anchors=none,deep=1", {}),
    # a 256-token budget splits each prompt into chunks, anywhere in it (`make test` runs the
    # deep suffix of 4; the other two, whose anchors and suffix the whole prompts above run,
    # are on demand)
    "bos-deep4-chunked": ("speed:lcut=22,anchors=bos,deep=4", {"max_num_batched_tokens": 256}),
    "bos-deep1-chunked": ("speed:lcut=22,anchors=bos,deep=1", {"max_num_batched_tokens": 256}),
    "none-deep1-chunked": ("speed:lcut=22,anchors=none,deep=1", {"max_num_batched_tokens": 256}),
}  # fmt: skip
ON_DEMAND = {"bos-deep1-chunked", "none-deep1-chunked"}
# two pipeline stages: test_vllm_scaleout.py, beside the other compiled pipeline engine


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=[LONG] if case in ON_DEMAND else []) for case in CASES]
)
def test_reused_prefixes_equal_the_engine_and_the_dense_reference(directory, smollm, case):
    method, options = CASES[case]
    conversation_reuses_prefixes(directory, smollm, method, options)


def conversation_reuses_prefixes(directory, smollm, method: str, options: dict) -> None:
    """Two questions on a document, a three-turn chat, then (with whole prompts on one worker)
    the document evicted by others and asked about again: vLLM's hits are the expected ones
    and every answer equals the engine's replay and the dense reference."""
    tok = smollm.tokenizer
    doc = exact_chat_prompt(tok, DOC, start=3)
    others = [exact_chat_prompt(tok, DOC, start=100 + 50 * i) for i in range(3)]

    def ask(n: int, seed: int, source: Callable[[list[Served]], list[int]]):
        return lambda served: source(served) + text(tok, n, seed)

    def then(i: int):  # the conversation of request i, its answer included
        return lambda served: served[i].ids + served[i].tokens

    # each chat turn's prompt ends 4 tokens short of a 128-token block boundary, so the answer
    # tokens fed back cross it and the next turn reuses them
    turn1 = -(-(DOC + 30) // BLOCK) * BLOCK - 4
    turn2 = -(-(turn1 + NEW + 30) // BLOCK) * BLOCK - 4
    steps = [
        ask(40, 1, lambda s: doc),  # 0: a document and a question
        ask(turn1 - DOC, 2, lambda s: doc),  # 1: another question on it
        ask(turn2 - turn1 - NEW, 3, then(1)),  # 2: turn two of the chat request 1 began
        ask(40, 4, then(2)),  # 3: turn three
        *(ask(40, 5 + i, lambda s, o=o: o) for i, o in enumerate(others)),  # 4-6: evict
        ask(40, 8, lambda s: doc),  # 7: the document again, recomputed
        ask(40, 9, lambda s: doc),  # 8: and reused once more
    ]
    whole_doc = DOC // BLOCK * BLOCK
    hits = [0, whole_doc, turn1 + 4, turn2 + 4, 0, 0, 0, 0, whole_doc]
    length = turn2 + NEW + 40 + NEW
    if options:  # chunks or pipeline stages: the document and the chat, eviction left out
        steps, hits, llm_args = steps[:4], hits[:4], {"max_model_len": length}
    else:
        # a pool that holds the blocks of three such requests (their token blocks in each
        # lower KV cache group, one in the upper): requests 4-6 push out everything older
        _, lower, upper = SpeedSettings.from_overrides(
            engine_args(method, directory)["hf_overrides"]
        ).kv_groups(30)
        blocks = -(-(DOC + 40 + NEW) // BLOCK)
        llm_args = {
            "num_gpu_blocks_override": 3 * (blocks * lower + upper),
            "max_model_len": length,
        }
    served = serve(directory, method, steps, **{**llm_args, **options})

    assert [s.hit for s in served] == hits
    check(Replay(smollm, method), served, skip=(4, 5, 6))  # the others' documents: fresh


def check(replay: Replay, served: list[Served], skip: tuple[int, ...] = ()) -> None:
    """Each served request (but those in `skip`) against the engine's replay and the dense
    reference."""
    for i, request in enumerate(served):
        if i in skip:
            continue
        tokens, depth = replay.run(request.ids, request.hit)
        assert request.tokens == tokens, f"request {i}, {request.hit} tokens reused"
        reference = replay.dense(request.ids, tokens, depth)
        assert reference.argmax(-1).tolist() == tokens, f"request {i}"
        chosen = reference[torch.arange(len(tokens)), torch.tensor(tokens)]
        gap = (chosen - torch.tensor(request.logprobs)).abs().max()
        assert gap < LOGPROB_TOLERANCE, f"request {i}: vLLM's log-probabilities differ by {gap}"


def test_a_prompt_answered_in_its_prefill_step_is_cached(directory, smollm):
    """One new token: the request ends in the step that computed its prompt, and its rows are
    recorded as it is freed, for the next question on the same document."""
    method, tok = "speed:lcut=22,anchors=bos,deep=4", smollm.tokenizer
    doc = exact_chat_prompt(tok, DOC, start=3)
    steps = [lambda s, n=n: doc + text(tok, 30, n) for n in (1, 2)]
    served = serve(directory, method, steps, new=1)
    assert [s.hit for s in served] == [0, DOC // BLOCK * BLOCK]
    check(Replay(smollm, method, new=1), served)


def test_a_preempted_request_resumes_from_its_own_cached_prefix(
    directory, smollm, reference, monkeypatch
):
    """Two prompts that fill their blocks exactly, in a pool with one block to spare: at the
    first decode step vLLM preempts one and frees its blocks, the other takes three of them,
    and the rest stay cached. The preempted request resumes from its own cached prefix (vLLM's
    metrics leave preempted requests' hits out, so the upper layers' manager is watched) and
    gives the engine's tokens."""
    from speedkv.vllm.kv_spec import SpeedUpperManager

    resumed_from: list[int] = []
    add = SpeedUpperManager.add_local_computed_blocks

    def watched(self, request_id, blocks, tokens, external):
        resumed_from.append(tokens)
        return add(self, request_id, blocks, tokens, external)

    monkeypatch.setattr(SpeedUpperManager, "add_local_computed_blocks", watched)
    method = "speed:lcut=22,anchors=bos,deep=4"
    prompts = [exact_chat_prompt(smollm.tokenizer, 640, start=13 * i) for i in range(2)]
    args = engine_args(method, directory)
    _, lower, upper = SpeedSettings.from_overrides(args["hf_overrides"]).kv_groups(30)
    run = run_vllm(directory, prompts, 16, **args, max_model_len=1024,
                   num_gpu_blocks_override=2 * (5 * lower + upper) + 1)  # fmt: skip
    assert run.preemptions == 1
    assert max(resumed_from) >= 2 * BLOCK
    assert run.tokens == reference(method, prompts, 16)
