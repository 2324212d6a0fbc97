"""The two halves of a SPEED model's layer loop, each compiled by vLLM on its own.

vLLM compiles a model's backbone as one graph over every row of a step. Under SPEED the upper
layers take a different row set than the lower ones, so the backbone is split where the cut is
(on this pipeline rank), as vLLM's Gemma3n splits its self- and cross-decoder:

- `LowerStack`: the embedding (first rank) and the layers below the cut, over every row,
- `UpperStack`: the layers from the cut up, over the gathered full-depth rows, and the final
  norm on the last rank.

Each is a module of its own class, compiled with `support_torch_compile` under its own model
tag, with the row count dynamic: one trace serves every step. The gather and scatter between
them run eagerly (`models.py`). With compilation off (enforce_eager) both run as plain modules.

The stacks hold the model's own layers without registering them as submodules, so the weights
keep their names and load once.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile

ROWS = {0: "rows"}


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": ROWS,
        "positions": ROWS,
        "hidden_states": ROWS,
        "residual": ROWS,
        "inputs_embeds": ROWS,
    }
)
class LowerStack(nn.Module):
    """Embedding (if `embed`) and `layers`, over every row of a step."""

    def __init__(self, *, vllm_config, prefix: str = "", model: nn.Module, layers: list,
                 embed: bool) -> None:  # fmt: skip
        super().__init__()
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_layers", tuple(layers))
        self.embed = embed

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.embed:
            hidden_states = (
                self._model.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            )
            residual = None
        for layer in self._layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states, residual


@support_torch_compile(
    dynamic_arg_dims={"positions": ROWS, "hidden_states": ROWS, "residual": ROWS}
)
class UpperStack(nn.Module):
    """`layers` over the full-depth rows, then the final norm if `norm`."""

    def __init__(self, *, vllm_config, prefix: str = "", layers: list,
                 norm: nn.Module | None) -> None:  # fmt: skip
        super().__init__()
        object.__setattr__(self, "_layers", tuple(layers))
        object.__setattr__(self, "_norm", norm)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self._layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if self._norm is not None:
            hidden_states, residual = self._norm(hidden_states, residual)
        return hidden_states, residual
