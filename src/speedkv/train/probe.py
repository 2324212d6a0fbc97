"""A quick quality probe during training, on the calibration split of the training corpus
(never evaluation text):
passkey retrieval through the engine's real SPEED prefill and decode, and continuation
perplexity through the teacher-forcing forward. Its curve against steps shows when a run
has learnt what it needs (checkpoints are judged later by the evaluation harness)."""

from __future__ import annotations

import math
import random

import torch

from speedkv.hf.loading import LoadedModel
from speedkv.prompts.builders import TextSource
from speedkv.prompts.haystack import plant
from speedkv.train.data import tokenize_record
from speedkv.train.forward import Visibility, response_logits
from speedkv.train.tasks import PASSKEY_FACTS, continuation

PROBE_QUESTION = "What is the pass key?"


class Probe:
    def __init__(
        self,
        tokenizer,
        vis: Visibility,
        seq_len: int,
        every: int,
        seed: int,
        text: str = "pydocs",
        n: int = 4,
    ):
        self.tokenizer = tokenizer
        self.vis = vis
        self.every = every
        rng = random.Random(seed + 7919)
        source = TextSource(tokenizer, split=f"{text}:calib")
        self.passkeys = []
        for _ in range(n):
            key = str(rng.randrange(10000, 100000))
            text = plant(
                source.text(rng, seq_len - 96), PASSKEY_FACTS[0].format(num=key), rng.random()
            )
            record = {
                "messages": [
                    {"role": "user", "content": f"{text}\n\n{PROBE_QUESTION}"},
                    {"role": "assistant", "content": key},
                ]
            }
            example = tokenize_record(tokenizer, record)
            self.passkeys.append((example, key))
        self.texts = [
            tokenize_record(tokenizer, continuation(rng, source, seq_len - 256)) for _ in range(n)
        ]

    def inference_model(self, weights) -> LoadedModel:
        """The model as inference will run it: a copy of the trained weights (an adapter
        merged in), in `auto`'s dtype for work on transformers' own layers (the perplexity's
        teacher-forced forward is most of a probe): bfloat16 where the device has bf16
        instructions, else float32, whose products there are several times faster."""
        from speedkv.hf.loading import resolve_dtype, wrap_model

        model = weights.inference_copy()
        device = next(model.parameters()).device
        model.to(resolve_dtype("auto", device, native_decode=False))
        return wrap_model(model, self.tokenizer, "training", "")

    @torch.no_grad()
    def run(self, objective) -> dict:
        from speedkv.core.engine import Engine, Request
        from speedkv.core.registry import make_policy
        from speedkv.core.sampling import SamplingParams

        model = self.inference_model(objective.weights)
        engine = Engine(model)
        requests = [
            Request(
                example.ids[: example.prompt_len].tolist(),
                make_policy(self.vis.spec, engine.shape),
                SamplingParams(max_new_tokens=16),
                example.header_tokens,
                example.turn_tokens,
            )
            for example, _ in self.passkeys
        ]
        found = [
            key in result.text for result, (_, key) in zip(engine.generate(requests), self.passkeys)
        ]
        nll = tokens = 0.0
        for example in self.texts:
            logits = response_logits(
                model.backbone,
                example.ids,
                example.prompt_len,
                self.vis,
                example.header_tokens,
                example.turn_tokens,
            )
            targets = example.ids[example.prompt_len :].to(logits.device)
            nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            tokens += targets.numel()
        return {
            "probe_passkey_acc": sum(found) / len(found),
            "probe_ppl": round(math.exp(nll / tokens), 3),
        }
