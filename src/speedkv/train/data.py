"""Training data: the built-in mix (seeded, from the training split of a text corpus that no
evaluation uses: Python's documentation by default), users' JSONL files, and the tokenised
examples the trainer consumes.

`--data builtin` uses the default weights; `--data builtin:needle=3,continue=2` sets some of
them (the rest keep theirs, 0 drops a task), and `builtin:strings=0.15` adds a task the default
leaves out (EXTRA_TASKS). `--data FILE.jsonl` reads one record a line:
`{"messages": [{"role": "user", "content": ...}, ..., {"role": "assistant", "content": ...}]}`
trains on the last assistant message with everything before it as the (shallow) prompt;
`{"prompt": ..., "response": ...}` is raw text, no chat template.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from speedkv.core.spec import split_spec
from speedkv.errors import UserError
from speedkv.prompts.builders import TextSource
from speedkv.train.tasks import TASKS

DEFAULT_WEIGHTS: dict[str, float] = {
    "needle": 0.20,
    "passkey": 0.05,
    "kv": 0.10,
    "vartrack": 0.08,
    "multiquery": 0.07,
    "wordfreq": 0.08,
    "continue": 0.27,
    "instruct": 0.15,
}
# tasks a mix may name but the default leaves out (`builtin:strings=0.15` adds one); left out of
# DEFAULT_WEIGHTS so that the default mix, and so every recorded run's data, stays as it was
EXTRA_TASKS = tuple(task for task in TASKS if task not in DEFAULT_WEIGHTS)
# the corpus the built-in mix draws its text from (speedkv.prompts.haystack.CORPORA)
DEFAULT_TEXT = "pydocs"
MIN_PROMPT_TOKENS = 256
MIN_SEQ_LEN = 512  # room for the shortest haystack, a question and its answer
INSTRUCT_MAX_NEW_TOKENS = 128

# Writes the base model's full-depth answers into instruct records: list of message lists ->
# list of (answer text, finished with EOS).
Responder = Callable[[list[list[dict]]], list[tuple[str, bool]]]


@dataclass
class Example:
    """One tokenised training example: the prompt is ids[:prompt_len], the response the rest."""

    ids: torch.Tensor  # [T] long
    prompt_len: int
    header_tokens: int | None  # chat generation-header length, for deep=header
    kind: str
    turn_tokens: int | None = None  # the last prompt message through the header, for deep=turn

    @property
    def response_len(self) -> int:
        return int(self.ids.numel()) - self.prompt_len


def parse_mix(data: str) -> dict[str, float] | None:
    """Task weights for `builtin[:task=w,...]`, or None when `data` names a JSONL file."""
    if data != "builtin" and not data.startswith("builtin:"):
        return None
    _, options = split_spec(data)
    weights = dict(DEFAULT_WEIGHTS)
    for task, raw in options.items():
        if task not in TASKS:
            raise UserError(f"the built-in mix has no task '{task}'; tasks: {', '.join(TASKS)}")
        try:
            weights[task] = float(raw)
        except ValueError:
            raise UserError(f"weight of task '{task}' must be a number, got '{raw}'") from None
        if weights[task] < 0:
            raise UserError(f"weight of task '{task}' must be >= 0, got {raw}")
    if sum(weights.values()) <= 0:
        raise UserError("the built-in mix needs at least one task with a positive weight")
    return weights


def mix_spec(weights: dict[str, float]) -> str:
    """The canonical `builtin:...` spec of a set of weights (for records and resumption)."""
    return "builtin:" + ",".join(f"{k}={v:g}" for k, v in weights.items())


def build_mix(
    tokenizer,
    count: int,
    weights: dict[str, float],
    seq_len: int,
    seed: int,
    responder: Responder | None = None,
    progress: bool = True,
    text: str = DEFAULT_TEXT,
) -> list[dict]:
    """`count` records drawn from the weighted tasks, deterministic in `seed`, with text from
    the training split of the corpus `text`.

    Each record fits in `seq_len` tokens (prompt and response). Instruct records get their
    answers from `responder` (the base model at full depth); without one they are left out.
    """
    from tqdm import tqdm

    if seq_len < MIN_SEQ_LEN:
        raise UserError(
            f"seq-len of the built-in mix must be at least {MIN_SEQ_LEN}, got {seq_len}"
        )
    rng = random.Random(seed)
    source = TextSource(tokenizer, split=f"{text}:train")
    tasks = [t for t, w in weights.items() if w > 0 and (t != "instruct" or responder)]
    if not tasks:
        raise UserError("the mix has no task left to build (instruct needs the base model)")
    chosen = rng.choices(tasks, weights=[weights[t] for t in tasks], k=count)
    records = []
    for task in tqdm(chosen, desc="building data", disable=not progress, leave=False):
        records.append(_fitting_record(tokenizer, task, rng, source, seq_len))
    pending = [r for r in records if r["kind"] == "instruct"]
    if pending and responder is not None:
        answers = responder([r["messages"][:-1] for r in pending])
        for record, (text, finished) in zip(pending, answers):
            record["messages"][-1]["content"] = text
            record["eos"] = finished or not text  # an empty answer is an immediate EOS
    return records


def _fitting_record(tokenizer, task: str, rng: random.Random, source: TextSource, seq_len: int):
    """A record of the task whose prompt is MIN_PROMPT_TOKENS..seq_len long (with room for the
    answer), regenerated shorter if the estimate overshot."""
    reserve = 96 if task != "continue" else 0
    budget = rng.randint(MIN_PROMPT_TOKENS, seq_len - reserve - 64)
    for _ in range(8):
        record = TASKS[task](rng, source, budget)
        total = _token_count(tokenizer, record)
        limit = seq_len - (INSTRUCT_MAX_NEW_TOKENS if task == "instruct" else 0)
        if total <= limit:
            return record
        budget -= total - limit + 32
    raise RuntimeError(f"could not fit a '{task}' record into {seq_len} tokens")


def _token_count(tokenizer, record: dict) -> int:
    example = tokenize_record(tokenizer, _with_placeholder(record))
    return int(example.ids.numel())


def _with_placeholder(record: dict) -> dict:
    if "messages" in record and record["messages"][-1]["content"] is None:
        messages = record["messages"][:-1] + [{"role": "assistant", "content": "x"}]
        return {**record, "messages": messages}
    return record


# -- files ------------------------------------------------------------------------------------
def save_jsonl(records: list[dict], path: Path, meta: dict) -> None:
    """Records after one meta line (what built them), written atomically."""
    tmp = path.with_suffix(".partial")
    with tmp.open("w", encoding="utf-8") as out:
        out.write(json.dumps({"meta": meta}) + "\n")
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)


def load_built(path: Path, meta: dict) -> list[dict] | None:
    """Records of a previously built mix if it was built with the same `meta`, else None."""
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as lines:
        first = json.loads(next(lines, "{}") or "{}")
        if first.get("meta") != meta:
            return None
        return [json.loads(line) for line in lines if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """A user's training file, validated line by line."""
    if not path.is_file():
        raise UserError(f"data file '{path}' does not exist")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{number} is not valid JSON ({err.msg})") from None
        records.append(_validated(record, f"{path}:{number}"))
    if not records:
        raise UserError(f"data file '{path}' holds no records")
    return records


def _validated(record, where: str) -> dict:
    if not isinstance(record, dict):
        raise UserError(f"{where}: each line must be a JSON object")
    if "meta" in record:  # the first line of a built mix
        raise UserError(f"{where}: a built mix file is read with --data builtin, not as JSONL")
    if "messages" in record:
        messages = record["messages"]
        ok = isinstance(messages, list) and len(messages) >= 2
        ok = ok and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
            for m in messages
        )
        if not ok or messages[-1]["role"] != "assistant":
            raise UserError(
                f"{where}: 'messages' must be a list of at least two {{role, content}} objects "
                "ending with the assistant's message"
            )
        return {"kind": record.get("kind", "chat"), "messages": messages}
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        if not record["prompt"] or not record["response"]:
            raise UserError(f"{where}: 'prompt' and 'response' must not be empty")
        return {"kind": record.get("kind", "raw"), **record}
    raise UserError(
        f"{where}: a record needs 'messages' (chat) or 'prompt' and 'response' (raw text)"
    )


# -- tokenisation -----------------------------------------------------------------------------
def tokenize_record(tokenizer, record: dict) -> Example:
    """Prompt and response ids exactly as inference would see them.

    A chat prompt is what `encode_messages` gives for the conversation before the last
    message (ending with the generation header); the response is the rendering of the last
    message up to and including its end-of-turn token (left out when the answer was cut
    short). Raw records: the prompt as `encode_prompt(chat=False)` tokenises it, then the
    response's tokens.
    """
    from speedkv.hf.text import encode_messages

    kind = record.get("kind", "chat")
    if "messages" not in record or not getattr(tokenizer, "chat_template", None):
        prompt, response = _raw_texts(tokenizer, record)
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        tail = tokenizer(response, add_special_tokens=False)["input_ids"]
        return _example(ids, tail, None, kind)
    messages = record["messages"]
    encoded = encode_messages(tokenizer, messages[:-1])
    head = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    if not whole.startswith(head):
        raise UserError("the model's chat template renders a conversation inconsistently")
    answer = messages[-1]["content"]
    response = whole[len(head) :].rstrip("\n")
    if not record.get("eos", True):  # cut short: no end-of-turn token to learn
        at = response.find(answer.strip())
        response = response[: at + len(answer.strip())] if at >= 0 else answer
    tail = tokenizer(response, add_special_tokens=False)["input_ids"]
    return _example(encoded.ids, tail, encoded.header_tokens, kind, encoded.turn_tokens)


def _raw_texts(tokenizer, record: dict) -> tuple[str, str]:
    if "messages" not in record:
        return record["prompt"], record["response"]
    # no chat template: the turns as plain paragraphs, the answer ending with EOS
    messages = record["messages"]
    prompt = "\n\n".join(m["content"] for m in messages[:-1]) + "\n\n"
    eos = tokenizer.eos_token if record.get("eos", True) and tokenizer.eos_token else ""
    return prompt, messages[-1]["content"] + eos


def _example(
    prompt: list[int],
    response: list[int],
    header: int | None,
    kind: str,
    turn: int | None = None,
) -> Example:
    if not prompt or not response:
        raise UserError(f"a '{kind}' record has an empty prompt or response after tokenisation")
    ids = torch.tensor(list(prompt) + list(response), dtype=torch.long)
    return Example(ids, len(prompt), header, kind, turn)


def tokenize_all(tokenizer, records: list[dict], seq_len: int) -> tuple[list[Example], int]:
    """Examples that fit in seq_len tokens, and how many records were too long."""
    examples = [tokenize_record(tokenizer, r) for r in records]
    kept = [e for e in examples if e.ids.numel() <= seq_len]
    if not kept:
        raise UserError(f"no training record fits in --seq-len {seq_len} tokens")
    return kept, len(examples) - len(kept)


def base_model_responder(loaded, max_new_tokens: int = INSTRUCT_MAX_NEW_TOKENS) -> Responder:
    """Answers from the untrained model at full depth, greedy, generated in batches."""
    from tqdm import tqdm

    from speedkv.core.engine import Engine, Request
    from speedkv.core.registry import make_policy
    from speedkv.core.sampling import SamplingParams
    from speedkv.hf.text import encode_messages

    engine = Engine(_inference_copy(loaded))
    sampling = SamplingParams(max_new_tokens=max_new_tokens)

    def respond(conversations: list[list[dict]]) -> list[tuple[str, bool]]:
        answers: list[tuple[str, bool]] = []
        bar = tqdm(total=len(conversations), desc="base-model answers", leave=False)
        for start in range(0, len(conversations), 8):
            requests = []
            for messages in conversations[start : start + 8]:
                encoded = encode_messages(loaded.tokenizer, messages)
                policy = make_policy("full", loaded.shape)
                requests.append(Request(encoded.ids, policy, sampling, encoded.header_tokens))
            for result in engine.generate(requests):
                answers.append((result.text.strip(), result.finish_reason == "stop"))
            bar.update(len(requests))
        bar.close()
        return answers

    return respond


def _inference_copy(loaded):
    """The model in bfloat16 where that is fast (the training copy stays float32)."""
    import copy

    from speedkv.hf.loading import LoadedModel, resolve_dtype

    dtype = resolve_dtype("auto", loaded.backbone.device)
    if dtype == loaded.dtype:
        return loaded
    hf_model = copy.deepcopy(loaded.hf_model).to(dtype)
    return LoadedModel(loaded.name, hf_model, loaded.tokenizer, loaded.source)
