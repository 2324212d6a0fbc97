"""One path from a command's model options to what a backend runs.

`--model`, `--adapter`, `--weights`, `--dtype`, `--device` and `--prepack` are gathered into one
`ModelOptions`; `build_model` turns them into the model speedkv's engine runs (loaded, the
adapter merged, the linear weights quantized, decode prepacked), `build_vllm_model` into the
HF directory and dtype vLLM loads (the adapter merged into a cached copy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from speedkv.hf import loading
from speedkv.hf.loading import (
    DEFAULT_MODEL,
    LoadedModel,
    dtype_name,
    resolve_device,
    resolve_dtype,
    with_weights,
)
from speedkv.log import log


@dataclass(frozen=True)
class ModelOptions:
    """A model as a command's options ask for it."""

    model: str = DEFAULT_MODEL  # an embedded name, an HF directory or a GGUF file
    adapter: Path | None = None  # a LoRA adapter merged into the weights
    weights: str = "native"  # or "int8": weight-only int8 linear layers
    dtype: str = "auto"
    device: str = "auto"
    prepack: bool = False  # decode on a copy of the weights packed for one-row products
    # whether the work's products run on speedkv's decode kernel (its engine's do); those of
    # vLLM and of transformers' own layers do not, which changes what `auto` is on some CPUs
    native_decode: bool = True

    @property
    def label(self) -> str:
        """How results name the model: its name, and its weights when not the native ones (so
        runs of both are never mixed on --resume)."""
        return self.model if self.weights == "native" else f"{self.model}+{self.weights}"

    def torch_dtype(self) -> torch.dtype:
        """The dtype `dtype` stands for on this machine's `device`."""
        return resolve_dtype(self.dtype, resolve_device(self.device), self.native_decode)

    def with_adapter(self, adapter: Path | None) -> ModelOptions:
        return dataclasses.replace(self, adapter=adapter)


def build_model(options: ModelOptions) -> LoadedModel:
    """The model speedkv's engine runs: loaded, with the LoRA adapter merged into it when one
    is given, then its linear weights quantized when `weights` asks for it; with `prepack`,
    decode runs on a copy of the weights prepacked for one-row products."""
    from speedkv.hf.adapters import apply_adapter

    weights = "" if options.weights == "native" else f" ({options.weights} weights)"
    log(f"loading {options.model}{weights}")
    # looked up at each call, so that tests can stand a model in for the loader
    loaded = loading.load_model(options.model, dtype=options.torch_dtype(), device=options.device)
    if options.adapter is not None:
        loaded = apply_adapter(loaded, options.adapter)
    loaded = with_weights(loaded, options.weights)
    loaded.backbone.prepack_decode(options.prepack)
    return loaded


@dataclass(frozen=True)
class VllmModel:
    """What vLLM loads: an HF directory and the dtype for it."""

    directory: Path
    dtype: str


def build_vllm_model(
    options: ModelOptions, check: Callable[[Path], object] | None = None
) -> VllmModel:
    """The HF directory vLLM loads for these options, the model's own or a cached copy with
    the adapter merged into its weights, and its dtype (vLLM's products do not run on
    speedkv's decode kernel; vLLM runs where its platform says, as `auto` does). `check`
    sees the model's own directory first: what vLLM cannot run is refused before a merge."""
    from speedkv.hf.adapters import merged_directory

    directory = loading.model_directory(options.model)
    if check is not None:
        check(directory)
    if options.adapter is not None:
        log(f"merging {options.adapter} into {options.model} for vLLM (once; cached)")
        directory = merged_directory(options.model, options.adapter)
    plain = dataclasses.replace(options, device="auto", native_decode=False)
    return VllmModel(directory, dtype_name(plain.torch_dtype()))
