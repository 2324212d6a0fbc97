"""From a validated request body to engine requests: the method, the tokens, the sampling
parameters, and every limit the server enforces. Generation itself (EOS, stop strings, max
tokens, seeds) is the engine's; this module only translates OpenAI's names into it."""

from __future__ import annotations

from dataclasses import dataclass

from speedkv.core.engine import Engine, Request
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.hf.text import encode_messages
from speedkv.server.config import ServerConfig
from speedkv.server.errors import APIError
from speedkv.server.schemas import (
    SEED_MAX,
    SEED_MIN,
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Prepared:
    requests: list[Request]  # one per choice, in choice order
    prompt_tokens: int  # summed over prompts (not choices), for `usage`
    choices: int  # requests per prompt (n): they come prompt by prompt
    method: str  # canonical spec
    stream: bool
    include_usage: bool


class Preparer:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.shape = engine.shape

    def completion(self, body: CompletionRequest) -> Prepared:
        self._check_common(body)
        texts = _prompt_list(body.prompt)
        self._check_count(len(texts), body.n)
        prompts = [(self._tokens(p), None, None) for p in texts]
        return self._prepare(
            body, prompts, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt"
        )

    def chat(self, body: ChatCompletionRequest) -> Prepared:
        self._check_common(body)
        self._check_count(1, body.n)
        messages = []
        for i, message in enumerate(body.messages):
            content = message.content
            if not isinstance(content, str):
                content = "\n".join(part.text for part in content)
            _check_text(content, f"messages.{i}.content")
            role = "system" if message.role == "developer" else message.role
            messages.append({"role": role, "content": content})
        try:
            encoded = encode_messages(self.tokenizer, messages)
        except Exception as err:  # the model's chat template refused this conversation
            if type(err).__module__.startswith("jinja2"):
                raise APIError(400, f"the chat template rejected the messages: {err}") from err
            raise
        max_tokens = body.max_completion_tokens or body.max_tokens
        prompts = [(encoded.ids, encoded.header_tokens, encoded.turn_tokens)]
        return self._prepare(body, prompts, max_tokens, None, "messages")

    # -- shared ---------------------------------------------------------------------------
    def _check_common(self, body: _Sampling) -> None:
        if body.model != self.config.model_name:
            raise APIError(
                404,
                f"The model '{body.model}' does not exist; this server serves "
                f"'{self.config.model_name}'",
                param="model",
                code="model_not_found",
            )
        for stop in _stop_list(body.stop):
            _check_text(stop, "stop")

    def _check_count(self, prompts: int, n: int | None) -> None:
        sequences = prompts * (n or 1)
        if sequences > self.config.max_queue:
            raise APIError(
                400,
                f"this request asks for {sequences} sequences (prompts x n); "
                f"this server queues at most {self.config.max_queue}",
                param="n",
            )

    def _prepare(
        self,
        body: _Sampling,
        prompts: list[tuple[list[int], int | None, int | None]],  # ids, header, turn tokens
        max_tokens: int | None,
        default_max_tokens: int | None,
        prompt_param: str,
    ) -> Prepared:
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
        spec = self._method(body)
        n = body.n or 1
        extra = body.speedkv
        temperature, top_p = _temperature_top_p(body.temperature, body.top_p)
        requests = []
        for ids, header, turn in prompts:
            budget = self._max_tokens(len(ids), max_tokens, default_max_tokens, prompt_param)
            for choice in range(n):
                sampling = SamplingParams(
                    max_new_tokens=budget,
                    temperature=temperature,
                    top_k=(extra.top_k or 0) if extra else 0,
                    top_p=top_p,
                    seed=None if body.seed is None else _nth_seed(body.seed, choice),
                    stop=tuple(_stop_list(body.stop)),
                    ignore_eos=bool(extra and extra.ignore_eos),
                )
                request = Request(ids, self.engine.policy(spec), sampling, header, turn)
                self.engine.check_request(request)  # UserError -> 400
                requests.append(request)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        prompt_tokens = sum(len(ids) for ids, _, _ in prompts)
        return Prepared(requests, prompt_tokens, n, spec, bool(body.stream), include_usage)

    def _method(self, body: _Sampling) -> str:
        """The canonical spec this request runs: its own (if allowed and valid) or the server's."""
        asked = body.speedkv.method if body.speedkv else None
        if asked is None:
            return self.config.method
        param = "speedkv.method"
        try:
            policy = self.engine.policy(asked)
        except UserError as err:
            raise APIError(400, str(err), param=param, code="invalid_method") from err
        # a client must not make the server read files or load other models
        others = policy.external_models()
        if others:
            raise APIError(
                400,
                f"per-request methods may only use the served model, but '{asked}' would load "
                f"{', '.join(others)}; start the server with --method to use another model",
                param=param,
                code="invalid_method",
            )
        spec = policy.spec()
        if self.config.fixed_method and spec != self.config.method:
            raise APIError(
                400,
                f"this server runs only '{self.config.method}' (started with --fixed-method); "
                "leave speedkv.method out",
                param=param,
                code="method_not_allowed",
            )
        return spec

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        vocab = self.shape.vocab_size
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt"
            )
        return list(prompt)

    def _max_tokens(
        self, prompt_len: int, asked: int | None, default: int | None, prompt_param: str
    ) -> int:
        """The request's max_tokens, checked against the prompt, the context and the cap;
        without one, `default` (None: the rest of the context), within the cap."""
        limit, context = self.config.max_tokens_limit, self.shape.max_positions
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", prompt_param)
        if prompt_len > self.config.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; this server accepts at most "
                f"{self.config.max_prompt_tokens}",
                prompt_param,
                "context_length_exceeded",
            )
        room = context - prompt_len
        if asked is None:
            return min(default or room, room, limit or room)
        if limit is not None and asked > limit:
            raise APIError(
                400, f"max_tokens is {asked}; this server allows at most {limit}", "max_tokens"
            )
        if asked > room:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens; the prompt has "
                f"{prompt_len}, so max_tokens may be at most {room}, got {asked}",
                "max_tokens",
                "context_length_exceeded",
            )
        return asked


GREEDY_BELOW = 1e-5  # as vLLM: a temperature this small is greedy decoding
NUCLEUS_UNDERFLOW = 1e-30  # a top_p this small keeps only the likeliest token: greedy


def _temperature_top_p(temperature: float | None, top_p: float | None) -> tuple[float, float]:
    """OpenAI's defaults (1, 1), and the limits that mean greedy decoding made greedy: the
    engine samples in float32, where such values underflow to 0 and sampling would fail."""
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    if temperature < GREEDY_BELOW or top_p < NUCLEUS_UNDERFLOW:
        return 0.0, 1.0
    return temperature, top_p


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # e.g. a lone UTF-16 surrogate escaped in the JSON
        raise APIError(400, f"{param} is not valid Unicode text ({err.reason})", param) from err


def _prompt_list(prompt) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "the prompt list is empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _nth_seed(seed: int, choice: int) -> int:
    """Distinct seeds for the n choices of one request, kept in the generator's range."""
    span = SEED_MAX - SEED_MIN + 1
    return (seed + choice - SEED_MIN) % span + SEED_MIN
