"""The SPEED-aware teacher-forcing forward and its loss.

One training example is a prompt followed by a response. Under SPEED the prompt positions are
shallow (lower layers only), the anchors and the deep suffix of the prompt and every response
position are deep, exactly as at inference (`SpeedRule`; `full` is the rule with lcut = L).
The forward is the dense SPEED reference (`speedkv.analysis.dense.speed_hidden`): the lower
`lcut` layers over the whole sequence, then the upper layers over the gathered full-depth
positions alone, so a SPEED step does less work than a full one. The layers are
transformers' own (`Backbone.hf_layer`), so peft's LoRA-wrapped projections take part
without any change.

The LM head runs only on the rows that predict response tokens: on a 49K vocabulary the head
over a whole 2K-token sequence would cost a fifth of the model and bias the speed comparison.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speedkv.analysis.dense import speed_and_full_hidden, speed_hidden
from speedkv.core.registry import MethodSpec, parse_spec
from speedkv.errors import UserError
from speedkv.hf.backbone import Backbone, ModelShape
from speedkv.methods.speed import SpeedRule


@dataclass(frozen=True)
class Visibility(SpeedRule):
    """A training run's SPEED rule, with the canonical spec it was parsed from (what reports
    name and what the probe's inference policies are built from)."""

    spec: str = "full"


TRAINABLE_METHODS = ("full", "speed")


def check_trainable(spec: str | MethodSpec) -> MethodSpec:
    """The spec, parsed; fails early (before a model loads) on a method training has no rule
    for."""
    method = spec if isinstance(spec, MethodSpec) else parse_spec(spec)
    if method.name not in TRAINABLE_METHODS:
        raise UserError(
            f"training supports the methods 'full' and 'speed', not '{method.name}'; "
            "write e.g. --method 'speed:lcut=22,anchors=bos' or --method full"
        )
    return method


def visibility_for(spec: str | MethodSpec, shape: ModelShape) -> Visibility:
    """The training rule of a method spec; only `full` and `speed` have one."""
    policy = check_trainable(spec).bind(shape)
    rule = SpeedRule.of(policy)
    return Visibility(**dataclasses.asdict(rule), spec=policy.spec())


def response_logits(
    backbone: Backbone,
    ids: torch.Tensor,
    prompt_len: int,
    rule: SpeedRule,
    header_tokens: int | None = None,
    turn_tokens: int | None = None,
    states: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Float32 logits [R, vocab] of the rows predicting the response ids[prompt_len:]: the
    last prompt token (always in the deep suffix) and every response token but the last.
    `header_tokens` / `turn_tokens` are the prompt's, for `deep=header` / `deep=turn`.

    `states`, if given, receives the hidden states [R, H] of the same rows after each layer
    that runs over them at full depth: the layers from the cutoff up (every layer at full
    depth)."""
    _check_split(ids, prompt_len)
    taps: dict[int, torch.Tensor] | None = {} if states is not None else None
    h, pos = speed_hidden(
        backbone, ids, prompt_len, rule, header_tokens, turn_tokens=turn_tokens, taps=taps
    )
    rows = _response_rows(pos, prompt_len, ids.numel())
    if taps is not None and states is not None:
        # below the cutoff a layer's rows are every position, not `pos`
        first = 0 if rule.lcut >= backbone.shape.num_layers else rule.lcut
        states.update({layer: out[0, rows] for layer, out in taps.items() if layer >= first})
    return backbone.logits(h[rows])


def response_logits_with_full(
    backbone: Backbone,
    ids: torch.Tensor,
    prompt_len: int,
    rule: SpeedRule,
    header_tokens: int | None = None,
    turn_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`response_logits` under `rule` and at full depth, from one pass of the lower layers
    (`speed_and_full_hidden`): the full-depth term of `--keep-full` costs only the upper
    layers once more."""
    _check_split(ids, prompt_len)
    h, pos, h_full = speed_and_full_hidden(
        backbone, ids, prompt_len, rule, header_tokens, turn_tokens
    )
    every = torch.arange(ids.numel(), device=pos.device)
    return (
        backbone.logits(h[_response_rows(pos, prompt_len, ids.numel())]),
        backbone.logits(h_full[_response_rows(every, prompt_len, ids.numel())]),
    )


def _check_split(ids: torch.Tensor, prompt_len: int) -> None:
    if not 1 <= prompt_len < ids.numel():
        raise ValueError(f"prompt_len {prompt_len} leaves no prompt or no response")


def _response_rows(pos: torch.Tensor, prompt_len: int, length: int) -> torch.Tensor:
    """Bool over `pos`: the rows predicting a response token (the last prompt token and every
    response token but the last)."""
    return (pos >= prompt_len - 1) & (pos < length - 1)


@dataclass
class LossParts:
    """The loss of one example and its parts, summed over its response tokens."""

    loss_sum: torch.Tensor  # what is back-propagated (before division by the batch's tokens)
    ce_sum: float
    kl_sum: float
    tokens: int
    kl_full_sum: float = 0.0  # the trained weights at full depth against the teacher
    hidden_sum: float = 0.0  # the upper layers' relative squared error against the teacher's


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) at `temperature`, summed over rows, scaled by T^2 so that its
    gradient does not shrink with T."""
    log_s = F.log_softmax(student / temperature, dim=-1)
    log_t = F.log_softmax(teacher.to(student.device) / temperature, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="sum") * temperature**2


def hidden_match(
    student: dict[int, torch.Tensor], teacher: dict[int, torch.Tensor]
) -> torch.Tensor:
    """The student's hidden states against the teacher's at the same rows, in every layer
    the student has: ||s - t||^2 / ||t||^2 per row, summed over rows, averaged over layers.
    Relative, so that layers whose residual stream is larger do not outweigh the rest."""
    if not student or set(student) - set(teacher):
        raise ValueError("hidden matching needs the teacher's states in every student layer")
    errors = []
    for layer, s in student.items():
        t = teacher[layer].to(s.device, torch.float32)
        diff = (s.float() - t).pow(2).sum(-1)
        errors.append((diff / t.pow(2).sum(-1).clamp_min(1e-6)).sum())
    return torch.stack(errors).mean()


def example_loss(
    student: torch.Tensor,
    targets: torch.Tensor,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
    temperature: float = 1.0,
    student_full: torch.Tensor | None = None,
    keep_full: float = 0.0,
    student_states: dict[int, torch.Tensor] | None = None,
    teacher_states: dict[int, torch.Tensor] | None = None,
    match_hidden: float = 0.0,
) -> LossParts:
    """(1 - distill) * cross-entropy on the targets + distill * KL(teacher || student)
    + keep_full * KL(teacher || student_full) + match_hidden * `hidden_match`, summed over
    tokens.

    student, teacher, student_full: logits [R, vocab] (student_full: the trained weights at
    full depth, only with keep_full > 0); targets: [R] token ids; student_states and
    teacher_states: hidden states [R, H] by layer (only with match_hidden > 0).
    """
    targets = targets.to(student.device)
    ce = F.cross_entropy(student, targets, reduction="sum")
    loss = ce
    kl_value = kl_full_value = 0.0
    if teacher is not None and distill > 0:
        kl = distill_kl(student, teacher, temperature)
        loss = (1 - distill) * ce + distill * kl
        kl_value = float(kl.detach())
    if keep_full > 0:
        if teacher is None or student_full is None:
            raise ValueError("keep_full needs the teacher's and the full-depth student's logits")
        kl_full = distill_kl(student_full, teacher, temperature)
        loss = loss + keep_full * kl_full
        kl_full_value = float(kl_full.detach())
    hidden_value = 0.0
    if match_hidden > 0:
        if student_states is None or teacher_states is None:
            raise ValueError("match_hidden needs the student's and the teacher's hidden states")
        hidden = hidden_match(student_states, teacher_states)
        loss = loss + match_hidden * hidden
        hidden_value = float(hidden.detach())
    return LossParts(
        loss, float(ce.detach()), kl_value, int(targets.numel()), kl_full_value, hidden_value
    )


class SpeedObjective(torch.nn.Module):
    """The trained model as the HF Trainer (and DDP) see it: the trained weights (a peft
    model, or the HF model itself for full-parameter training) behind a forward that takes a
    batch of examples and returns the SPEED teacher-forcing loss.

    The loss is averaged over the batch's response tokens. With `distill > 0` or
    `keep_full > 0` the teacher is the untrained model (`weights.reference()`) at full depth,
    without gradients. `keep_full > 0` also runs the trained weights at full depth and pulls
    them toward the teacher, so that they serve full-depth requests as before while they
    learn SPEED (the upper layers run a second time, over every position). `match_hidden > 0`
    pulls SPEED's hidden states in the layers from the cutoff up toward the teacher's, at the
    rows that predict the response (`hidden_match`).
    """

    def __init__(
        self,
        weights,
        vis: Visibility,
        distill: float = 0.0,
        temperature: float = 1.0,
        keep_full: float = 0.0,
        match_hidden: float = 0.0,
    ):
        if keep_full > 0 and match_hidden > 0:
            raise ValueError("keep_full and match_hidden are not combined")
        super().__init__()
        self.weights = weights
        self.model = weights.model  # registered: what the optimizer and DDP see
        self.vis = vis
        self.distill = distill
        self.keep_full = keep_full
        self.match_hidden = match_hidden
        self.temperature = temperature
        self.backbone = weights.backbone
        self.full = SpeedRule.full(self.backbone.shape.num_layers)

    def forward(self, examples: list) -> dict:
        parts = [self.example_parts(example) for example in examples]
        tokens = sum(p.tokens for p in parts)
        loss = sum(p.loss_sum for p in parts) / tokens
        return {
            "loss": loss,
            "ce_sum": sum(p.ce_sum for p in parts),
            "kl_sum": sum(p.kl_sum for p in parts),
            "kl_full_sum": sum(p.kl_full_sum for p in parts),
            "hidden_sum": sum(p.hidden_sum for p in parts),
            "response_tokens": tokens,
            "sequence_tokens": sum(int(e.ids.numel()) for e in examples),
        }

    def example_parts(self, example) -> LossParts:
        ids, prompt_len = example.ids, example.prompt_len
        chat = (example.header_tokens, example.turn_tokens)
        student_full = None
        states = teacher_states = None
        if self.match_hidden > 0:
            states, teacher_states = {}, {}
        if self.keep_full > 0:
            student, student_full = response_logits_with_full(
                self.backbone, ids, prompt_len, self.vis, *chat
            )
        else:
            student = response_logits(self.backbone, ids, prompt_len, self.vis, *chat, states)
        teacher = None
        if self.distill > 0 or self.keep_full > 0 or self.match_hidden > 0:
            with torch.no_grad(), self.weights.reference() as reference:
                teacher = response_logits(
                    reference, ids, prompt_len, self.full, *chat, teacher_states
                )
        targets = example.ids[example.prompt_len :]
        return example_loss(
            student, targets, teacher, self.distill, self.temperature, student_full,
            self.keep_full, states, teacher_states, self.match_hidden,
        )  # fmt: skip
