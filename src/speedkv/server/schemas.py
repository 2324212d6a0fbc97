"""Request and response bodies of the OpenAI API subset the server speaks.

Requests are strict (no "3" for 3) and closed (an unknown field is an error, as with OpenAI),
so a client's typo is reported instead of silently ignored. Parameters OpenAI defines but the
engine does not implement are accepted only at their neutral value (`UNSUPPORTED`), and the
schema says so.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# torch.Generator.manual_seed accepts exactly this range
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_CHOICES = 16  # n per request
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOPS = 16

# parameter -> the only value(s) accepted, for the error message
UNSUPPORTED = {
    "presence_penalty": "0",
    "frequency_penalty": "0",
    "logit_bias": "null or {}",
    "echo": "false",
    "logprobs": "null or false",
    "top_logprobs": "null",
    "best_of": "null or 1",
    "suffix": "null",
}
NOT_SUPPORTED = "Not supported by this server: only the neutral value is accepted."

StopString = Annotated[str, Field(min_length=1)]


def _false_only(value: bool) -> bool:
    if value:
        raise ValueError("only false is supported")
    return value


# not Literal[False]: pydantic compares literals with ==, so it would take 0 for false
FalseOnly = Annotated[bool, AfterValidator(_false_only), Field(json_schema_extra={"enum": [False]})]


TokenId = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SpeedkvOptions(_Strict):
    """Extra body field `speedkv`: what OpenAI's API has no name for."""

    method: str | None = Field(
        None,
        description="Method spec for this request, e.g. 'speed:lcut=22,anchors=bos'; "
        "the server's method when absent.",
        min_length=1,
        max_length=512,
    )
    top_k: int | None = Field(None, ge=0, description="Keep the k likeliest tokens (0 = off).")
    ignore_eos: bool | None = Field(None, description="Keep generating past end-of-sequence.")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Sampling(_Strict):
    """Fields common to completions and chat completions."""

    model: str = Field(max_length=512)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOPS)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=0, le=0, description=NOT_SUPPORTED)
    frequency_penalty: float | None = Field(None, ge=0, le=0, description=NOT_SUPPORTED)
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description=NOT_SUPPORTED)
    user: str | None = Field(None, max_length=512)
    speedkv: SpeedkvOptions | None = None


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(description="Text, token ids, or a list of either (one choice set per prompt).")
    echo: FalseOnly | None = Field(None, description=NOT_SUPPORTED)
    logprobs: None = Field(None, description=NOT_SUPPORTED)
    best_of: int | None = Field(None, ge=1, le=1, description=NOT_SUPPORTED)
    suffix: None = Field(None, description=NOT_SUPPORTED)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=512)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: FalseOnly | None = Field(None, description=NOT_SUPPORTED)
    top_logprobs: None = Field(None, description=NOT_SUPPORTED)


# -- responses (documentation of what the handlers return) ------------------------------------
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        description="Prompt tokens taken from the server's prefix cache instead of prefilled."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SpeedkvStats(BaseModel):
    """Per-choice costs the engine measured (extra response field `speedkv`)."""

    method: str
    ttft_s: float
    tpot_s: float
    kv_bytes: int
    kv_bytes_final: int
    reused_tokens: int = Field(
        description="Prompt tokens taken from the prefix cache instead of prefilled."
    )


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speedkv: list[SpeedkvStats] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speedkv: list[SpeedkvStats] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    speedkv: dict | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    running: int
    waiting: int
