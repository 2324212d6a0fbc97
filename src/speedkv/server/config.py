"""The server's options, checked against the model before it starts serving."""

from __future__ import annotations

from dataclasses import dataclass

from speedkv.core.prefix import PrefixCache
from speedkv.core.registry import make_policy, parse_spec
from speedkv.errors import UserError
from speedkv.hf.backbone import ModelShape


@dataclass
class ServerConfig:
    model_name: str  # the id clients send as `model` and /v1/models lists
    method: str = "full"  # the method of requests that do not choose one
    fixed_method: bool = False  # forbid per-request methods
    max_batch: int = 16  # sequences decoding together
    max_queue: int = 64  # sequences waiting for a batch slot; more get 429
    max_prompt_tokens: int | None = None  # None: the model's context
    max_tokens_limit: int | None = None  # largest max_tokens a request may ask; None: no cap
    max_body_bytes: int = 4 * 2**20
    api_key: str | None = None
    prefix_cache_bytes: int = 2**30  # buffers cached prompts may hold; 0 turns caching off
    prefix_min_tokens: int = 16  # shortest cached prefix worth reusing

    def check(self) -> ServerConfig:
        """Reject settings that are wrong for any model (UserError), before one is loaded."""
        parse_spec(self.method)  # a malformed spec, unknown name or option fails here
        if self.max_batch < 1:
            raise UserError(f"max-batch must be at least 1, got {self.max_batch}")
        if self.max_queue < 1:
            raise UserError(f"max-queue must be at least 1, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise UserError(f"max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise UserError(f"max-prompt-tokens must be at least 1, got {self.max_prompt_tokens}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise UserError(f"max-tokens-limit must be at least 1, got {self.max_tokens_limit}")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("the API key is empty; give a non-empty --api-key or leave it out")
        if self.prefix_cache_bytes < 0:
            raise UserError(
                f"prefix-cache-bytes must be at least 0 (0 turns caching off), "
                f"got {self.prefix_cache_bytes}"
            )
        if self.prefix_min_tokens < 1:
            raise UserError(f"prefix-min-tokens must be at least 1, got {self.prefix_min_tokens}")
        return self

    def prefix_cache(self) -> PrefixCache | None:
        """The store of cached prompts these options ask for; None when caching is off."""
        if self.prefix_cache_bytes == 0:
            return None
        return PrefixCache(self.prefix_cache_bytes, self.prefix_min_tokens)

    def prefix_caching(self) -> str:
        """The prefix-cache setting in words, for the startup line."""
        if self.prefix_cache_bytes == 0:
            return "prefix caching off"
        return (
            f"prefix cache {self.prefix_cache_bytes / 2**20:g} MiB, "
            f"reused from {self.prefix_min_tokens} tokens"
        )

    def validate(self, shape: ModelShape, trained: str | None = None) -> ServerConfig:
        """Resolve defaults against the model and reject impossible settings (UserError)."""
        self.check()
        context = shape.max_positions
        if self.max_prompt_tokens is None:
            self.max_prompt_tokens = context - 1
        if not 1 <= self.max_prompt_tokens < context:
            raise UserError(
                f"max-prompt-tokens must be between 1 and {context - 1} (the model's context "
                f"is {context}), got {self.max_prompt_tokens}"
            )
        # canonical and checked; a SPEED spec takes what it leaves unset from the adapter
        self.method = make_policy(self.method, shape, trained).spec()
        return self
