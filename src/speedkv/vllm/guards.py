"""What SPEED cannot answer in vLLM gets a clear error instead of wrong numbers.

Prompt logprobs (and `echo` with logprobs in the completions API) score every prompt token at
the model's last layer; under SPEED most prompt tokens never reach the upper layers, so those
numbers would be silently wrong. The request is refused where vLLM checks its parameters, which
the OpenAI server turns into a 400.
"""

from __future__ import annotations

import functools

_GUARDED = "_speedkv_guarded"
PROMPT_LOGPROBS = (
    "prompt logprobs are not available under SPEED: prompt tokens below the deep suffix never "
    "reach the upper layers, so their logprobs would be wrong (serve method 'full' for scoring)"
)


def runs_speed(model_config) -> bool:
    """Whether a model config selects SPEED with at least one layer above the cut."""
    config = model_config.hf_config
    lcut = getattr(config, "speedkv_lcut", None)
    return lcut is not None and int(lcut) < int(config.num_hidden_layers)


def install_request_guard() -> None:
    """Wrap vLLM's request parameter check once per process."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    validate = InputProcessor._validate_params
    if getattr(validate, _GUARDED, False):
        return

    @functools.wraps(validate)
    def validate_for_speed(self, params, *args, **kwargs):
        if (
            isinstance(params, SamplingParams)
            and params.prompt_logprobs is not None
            and runs_speed(self.model_config)
        ):
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(PROMPT_LOGPROBS, parameter="prompt_logprobs")
        return validate(self, params, *args, **kwargs)

    setattr(validate_for_speed, _GUARDED, True)
    InputProcessor._validate_params = validate_for_speed
