"""What a training run changes: LoRA adapters on frozen weights, or every weight.

Both go through the same SPEED forward, loss, data, probes, checkpoints and resume; they
differ only in what the optimizer sees, what the distillation teacher is, and what a
checkpoint and the final result hold:

- `LoraWeights`: a peft model. The teacher is the same model with its adapter off; a
  checkpoint and the result are a peft adapter directory.
- `FullWeights`: the HF model itself, every parameter trained. The teacher is a frozen copy
  of the starting weights (only with distillation); a checkpoint and the result are an HF
  model directory, which every command takes as `--model`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch

from speedkv.errors import UserError
from speedkv.hf.adapters import require_peft
from speedkv.hf.backbone import Backbone

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GIB = 2**30


class LoraWeights:
    """LoRA adapters (peft) on the model's frozen weights."""

    kind = "lora"

    def __init__(
        self,
        hf_model,
        r: int = 16,
        alpha: int = 32,
        dropout: float = 0.0,
        target_modules: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
        name: str | None = None,
    ):
        peft = require_peft()
        present = {module.rsplit(".", 1)[-1] for module, _ in hf_model.named_modules()}
        missing = [m for m in target_modules if m not in present]
        if missing:
            raise UserError(
                f"target module(s) {', '.join(missing)} not in this model; it has e.g. "
                f"{', '.join(DEFAULT_TARGETS)}"
            )
        lora = peft.LoraConfig(
            r=r,
            lora_alpha=alpha,
            lora_dropout=dropout,
            target_modules=list(target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.model = peft.get_peft_model(hf_model, lora)
        if name:  # the adapter names its base model, not this machine's path
            for adapter_config in self.model.peft_config.values():
                adapter_config.base_model_name_or_path = name
        self.backbone = Backbone(self.model.base_model.model)

    @contextlib.contextmanager
    def reference(self) -> Iterator[Backbone]:
        """The untrained model (adapter off), for the distillation teacher."""
        with self.model.disable_adapter():
            yield self.backbone

    def inference_copy(self):
        """An HF model with the adapter merged into a copy of the weights."""
        return copy.deepcopy(self.model).merge_and_unload()

    def save(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """The adapter in peft format (only the LoRA weights, cast to `dtype` if given)."""
        if dtype is not None:
            for name, param in self.model.named_parameters():
                if "lora_" in name:
                    param.data = param.data.to(dtype)
        # embeddings are never trained here; "auto" would look the base model up on the Hub
        self.model.save_pretrained(str(directory), save_embedding_layers=False)
        Path(directory, "README.md").unlink(missing_ok=True)  # peft's empty model card

    def load(self, directory: str | Path) -> None:
        """The adapter weights of a checkpoint, into this model."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(directory, "adapter_model.safetensors")
        if not path.is_file():
            raise UserError(f"checkpoint '{directory}' holds no adapter")
        set_peft_model_state_dict(self.model, load_file(str(path)))


class FullWeights:
    """Every weight of the model trained (full-parameter fine-tuning)."""

    kind = "full"

    def __init__(self, hf_model, tokenizer=None, teacher: bool = False):
        self.model = hf_model
        self.tokenizer = tokenizer
        self.model.requires_grad_(True)
        self.backbone = Backbone(hf_model)
        # the starting weights, frozen: kept only when a distillation term needs them, and
        # held outside the module tree so the optimizer and checkpoints never see them
        self._teacher = None
        if teacher:
            frozen = copy.deepcopy(hf_model).eval().requires_grad_(False)
            self._teacher = Backbone(frozen)

    @contextlib.contextmanager
    def reference(self) -> Iterator[Backbone]:
        if self._teacher is None:
            raise RuntimeError("this run keeps no teacher copy (no distillation)")
        yield self._teacher

    def inference_copy(self):
        return copy.deepcopy(self.model)

    def save(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """An HF model directory (weights, config, tokenizer) every command loads."""
        model = self.model if dtype is None else copy.deepcopy(self.model).to(dtype)
        model.save_pretrained(str(directory))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory))

    def load(self, directory: str | Path) -> None:
        """The weights of a checkpoint, into this model (tied weights stay tied)."""
        from safetensors.torch import load_file

        files = sorted(Path(directory).glob("model*.safetensors"))
        if not files:
            raise UserError(f"checkpoint '{directory}' holds no model weights")
        state = {}
        for file in files:
            state.update(load_file(str(file)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
        if unexpected or [k for k in missing if k not in tied and "lm_head" not in k]:
            raise UserError(f"checkpoint '{directory}' does not fit this model")


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def full_training_bytes(
    hf_model,
    seq_len: int,
    batch: int,
    teacher: bool,
    checkpointing: bool,
) -> dict[str, int]:
    """Estimated memory of full-parameter training, by part: float32 weights, gradients and
    AdamW's two moments (4 + 4 + 8 bytes a parameter), the frozen teacher copy, and the
    activations kept for the backward pass (all of every layer's, or with checkpointing only
    each layer's input plus one layer's)."""
    config = hf_model.config
    params = sum(p.numel() for p in hf_model.parameters())
    hidden, layers = config.hidden_size, config.num_hidden_layers
    inner = getattr(config, "intermediate_size", 4 * hidden)
    tokens = seq_len * batch
    # per token and layer: norms, q/k/v/o and attention output, the MLP's three inner tensors
    # and their products, in float32 (bf16 autocast keeps some in half: this errs high)
    layer_activation = 4 * (12 * hidden + 6 * inner)
    if checkpointing:
        activations = tokens * (layers * 4 * hidden + layer_activation)
    else:
        activations = tokens * layers * layer_activation
    return {
        "weights": 4 * params,
        "gradients": 4 * params,
        "optimizer": 8 * params,
        "teacher": 4 * params if teacher else 0,
        "activations": activations,
    }


def available_bytes(device: str) -> int:
    """Memory this run can use: the GPU's free memory, or the system's available RAM."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(parts: dict[str, int], available: int, what: str) -> None:
    """One sentence and a way out when the estimate does not fit."""
    need = sum(parts.values())
    if need <= available:
        return
    detail = ", ".join(f"{name} {size / GIB:.1f}" for name, size in parts.items() if size)
    raise UserError(
        f"{what} needs about {need / GIB:.1f} GiB ({detail}) and {available / GIB:.1f} GiB "
        "are available; use --gradient-checkpointing, a smaller --seq-len or --batch, or "
        "LoRA (drop --full)"
    )
