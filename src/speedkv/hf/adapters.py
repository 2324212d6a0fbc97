"""Trained adapters: what they record about their training, and applying one for inference.

An adapter directory is peft's format (`adapter_config.json`, `adapter_model.safetensors`)
plus `training.json`: the base model and its shape, the method spec it was trained for, the
data, the recipe, wall time and tokens/s. For inference the adapter is merged into a copy of
the model's weights, so the engine runs plain Linear layers at full speed.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

from speedkv.errors import UserError
from speedkv.hf.loading import LoadedModel

INFO_NAME = "training.json"
FORMAT = "speedkv-adapter/1"
MODEL_FORMAT = "speedkv-model/1"  # the training.json of a full-parameter run's model directory
SHAPE_FIELDS = ("model_type", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim")


def require_peft():
    """The peft package, or one clear sentence on how to get it."""
    try:
        import peft
    except ImportError:
        raise UserError(
            "LoRA training and adapters need the peft package: pip install 'peft>=0.17'"
        ) from None
    return peft


def read_adapter_info(adapter_dir: str | Path) -> dict:
    """The adapter's training.json ({} for a peft adapter trained elsewhere)."""
    path = Path(adapter_dir)
    if not (path / "adapter_config.json").is_file() and (path / "config.json").is_file():
        raise UserError(
            f"'{adapter_dir}' is a model directory (such as `speedkv train --full` writes), "
            "not an adapter: pass it as --model"
        )
    if not (path / "adapter_config.json").is_file():
        raise UserError(
            f"'{adapter_dir}' is not an adapter directory: it has no adapter_config.json "
            "(give the --out directory of `speedkv train` or one of its checkpoints)"
        )
    info = path / INFO_NAME
    if not info.is_file():
        return {}
    try:
        return json.loads(info.read_bytes())
    except json.JSONDecodeError as err:
        raise UserError(f"'{info}' is not valid JSON ({err.msg})") from None
    except UnicodeDecodeError:
        raise UserError(f"'{info}' is not valid JSON (it is not UTF-8 text)") from None


def apply_adapter(loaded: LoadedModel, adapter_dir: str | Path) -> LoadedModel:
    """A new LoadedModel with the adapter merged into a copy of `loaded`'s weights; refuses
    an adapter trained for a model of another shape."""
    PeftModel = require_peft().PeftModel

    info = read_adapter_info(adapter_dir)
    _check_shape(info, loaded, adapter_dir)
    base = copy.deepcopy(loaded.hf_model)
    try:
        with warnings.catch_warnings():  # transformers deprecations peft triggers, not ours
            warnings.filterwarnings("ignore", category=FutureWarning)
            wrapped = PeftModel.from_pretrained(base, str(adapter_dir))
    except (ValueError, KeyError, RuntimeError) as err:
        raise UserError(f"the adapter in '{adapter_dir}' does not fit this model ({err})") from None
    merged = wrapped.merge_and_unload()
    merged.eval().requires_grad_(False)
    name = f"{loaded.name}+{Path(adapter_dir).name}"
    adapted = LoadedModel(name, merged, loaded.tokenizer, loaded.source, info.get("method"))
    adapted.backbone.prepack_decode(loaded.backbone.prepacked)  # decode as `loaded` does
    return adapted


def _check_shape(info: dict, loaded: LoadedModel, adapter_dir) -> None:
    recorded = info.get("model_shape")
    if not recorded:
        return
    actual = asdict(loaded.shape)
    differs = [k for k in SHAPE_FIELDS if k in recorded and recorded[k] != actual[k]]
    if differs:
        raise UserError(
            f"the adapter in '{adapter_dir}' was trained for "
            f"{info.get('base_model', 'another model')} "
            f"({', '.join(f'{k}={recorded[k]}' for k in differs)}), not for {loaded.name}"
        )


def merged_directory(model: str, adapter_dir: str | Path) -> Path:
    """An HF directory holding `model` with the adapter merged into its weights, written once
    into the cache (float32): how another engine, such as vLLM, runs a trained adapter."""
    import hashlib

    from speedkv.hf.loading import cache_dir, load_model, model_directory, only_one_process

    adapter = Path(adapter_dir)
    read_adapter_info(adapter)  # a clear error for a directory that is not an adapter
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if (adapter / name).is_file():
            digest.update((adapter / name).read_bytes())
    base = model_directory(model, progress=False)
    target = cache_dir() / "merged" / f"{base.name}+{adapter.name}-{digest.hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return target
    with only_one_process(target, f"merging {adapter.name}"):
        if not (target / "config.json").is_file():  # another process may have merged it meanwhile
            merged = apply_adapter(
                load_model(model, dtype="float32", device="cpu", progress=False), adapter
            )
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)  # left by a merge killed halfway
            merged.hf_model.save_pretrained(partial)
            merged.tokenizer.save_pretrained(partial)
            partial.replace(target)
    return target
