"""What a causal LM does to its head's output before the loss: logit scales and final soft-capping.

hf_memo's loss runs the head per mini-sequence, so it must apply the same transform per chunk. The
transform is read from the model's traits (Granite's ``logits_scaling``, Cohere's ``logit_scale``, Gemma's
``final_logit_softcapping``) and confirmed against the model's own forward (:func:`confirmed_logit_transform`):
an unknown transform is refused, never silently dropped. The same probe checks the model's own loss against
transformers' causal-LM loss of its logits, which hf_memo's chunked loss computes: another loss is refused.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from hf_memo.patches.backbone import backbone_of


@dataclass(frozen=True)
class LogitTransform:
    """``logits (..., V) -> logits (..., V)``, in the order the model applies it: ``* multiply``, ``/ divide``, then
    ``softcap * tanh(logits / softcap)``; the identity where all are unset."""

    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def describe(self) -> str:
        parts = [f"* {self.multiply}" if self.multiply is not None else "", f"/ {self.divide}" if self.divide else ""]
        parts.append(f"soft-cap {self.softcap}" if self.softcap is not None else "")
        return ", ".join(p for p in parts if p) or "none"


def logit_transform(model: PreTrainedModel) -> LogitTransform:
    """The transform ``model`` applies to its head's output, from its traits (not yet checked)."""
    text = model.config.get_text_config()
    scale = getattr(model, "logit_scale", None)
    scaling = getattr(text, "logits_scaling", None)
    return LogitTransform(
        multiply=float(scale) if isinstance(scale, (int, float)) else None,
        divide=float(scaling) if scaling is not None else None,
        softcap=getattr(text, "final_logit_softcapping", None)
        or getattr(model.config, "final_logit_softcapping", None),
    )


def holds_values(weight: torch.Tensor) -> bool:
    """Whether ``weight`` holds real values here (not meta, not a fake tensor, not a ZeRO-3 partition)."""
    return weight.numel() > 0 and weight.device.type != "meta" and not is_fake(weight)


class _HiddenStatesOnly(BaseModelOutputWithPast):
    """A backbone output with the last hidden states only: every other field a causal LM reads is ``None``."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


@contextlib.contextmanager
def _backbone_returning(backbone: nn.Module, hidden: torch.Tensor):
    def forward(*args: Any, **kwargs: Any) -> BaseModelOutputWithPast:
        return _HiddenStatesOnly(last_hidden_state=hidden)

    backbone.forward = forward
    try:
        yield
    finally:
        del backbone.forward


def _probe(
    model: PreTrainedModel, forward: Callable, hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logits, loss)`` that ``forward`` (the model's own forward) computes from ``hidden`` ``(1, n, H)`` given to it
    as the backbone's output and ``labels`` ``(1, n)``, in eval mode, without gradient (``loss`` ``None`` where the
    forward returns none); the model's modes are restored."""
    modes = {module: module.training for module in model.modules()}
    backbone = backbone_of(model)
    model.eval()
    try:
        with torch.no_grad(), _backbone_returning(backbone, hidden):
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            out = forward(input_ids=ids, labels=labels, **_quiet(forward))
    finally:
        for module, training in modes.items():
            module.training = training
    if hasattr(out, "logits"):
        return out.logits, out.loss
    return (out[1], out[0]) if len(out) > 1 and out[0].dim() == 0 else (out[0], None)


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, shift: int) -> float:
    """The mean cross-entropy of ``logits`` ``(1, n, V)`` (in float32, as transformers' loss) against ``labels``
    ``(1, n)`` ``shift`` positions on."""
    n = logits.shape[1]
    predicted = logits[:, : n - shift].float().flatten(0, 1)
    return nn.functional.cross_entropy(predicted, labels[:, shift:].flatten()).item()


def _check_loss(model: PreTrainedModel, loss: torch.Tensor | None, logits: torch.Tensor, labels: torch.Tensor) -> None:
    """Raise unless the model's own ``loss`` on the probe is transformers' causal-LM loss of its ``logits``
    ``(1, n, V)``: each position's logits against the next position's label, the mean over the labels.

    Raises:
        ValueError: another loss (e.g. CPM-Ant's, which scores each position against its own label), which
            hf_memo's chunked loss would not reproduce.
    """
    if loss is None:
        return
    got, want = float(loss), _causal_lm_loss(logits, labels, 1)
    tolerance = 1e-5 if logits.dtype in (torch.float32, torch.float64) else 1e-2
    if abs(got - want) <= tolerance * max(abs(want), 1.0):
        return
    unshifted = abs(got - _causal_lm_loss(logits, labels, 0)) <= tolerance * max(abs(got), 1.0)
    raise ValueError(
        f"hf_memo cannot patch {type(model).__name__} (model_type {model.config.model_type!r}): its loss is not "
        "transformers' causal-LM loss of its logits (each position's logits against the next position's label, "
        f"averaged): on a probe it is {got:.6g} where that loss is {want:.6g}"
        + (" (it scores each position against its own label, unshifted)" if unshifted else "")
        + ", so hf_memo's chunked loss would differ"
    )


def confirmed_logit_transform(model: PreTrainedModel, forward: Callable | None = None) -> LogitTransform:
    """The transform ``model``'s own ``forward`` (default ``model.forward``) applies to its head's output, its loss
    checked to be transformers' causal-LM loss of its logits (:func:`_check_loss`).

    The one its traits describe (:func:`logit_transform`) if the forward computes exactly that from random hidden
    states ``(1, 3, H)`` given in place of the backbone's output, else none if the forward ignores the traits (Gemma 3's
    multimodal class reads no ``final_logit_softcapping``); unchecked where the head holds no values here (meta,
    fake, partitioned).

    Raises:
        ValueError: neither: the model transforms its logits in a way hf_memo does not know; or its loss is another.
    """
    described = logit_transform(model)
    head = model.get_output_embeddings()
    weight = head.weight
    if not holds_values(weight):
        return described
    generator = torch.Generator(device=weight.device).manual_seed(0)
    hidden = torch.randn(1, 3, weight.shape[-1], generator=generator, device=weight.device).to(weight.dtype)
    labels = torch.randint(0, weight.shape[0], (1, 3), generator=generator, device=weight.device)
    logits, loss = _probe(model, forward or model.forward, hidden, labels)
    expected = logits.float()
    tolerance = 1e-6 if weight.dtype in (torch.float32, torch.float64) else 1e-2
    worst = float("nan")
    with torch.no_grad():
        for transform in dict.fromkeys([described, LogitTransform()]):
            got = transform(head(hidden)).float()
            if got.shape == expected.shape:
                if torch.allclose(expected, got, rtol=tolerance, atol=tolerance):
                    _check_loss(model, loss, logits, labels)
                    return transform
                worst = (expected - got).abs().max().item() if transform == described else worst
    raise ValueError(
        f"hf_memo cannot patch {type(model).__name__} (model_type {model.config.model_type!r}): its logits are "
        f"not its head's output with the transforms hf_memo knows (its traits say: {described.describe()}; largest "
        f"difference {worst:.3g}), so its loss per mini-sequence would differ"
    )


def _quiet(forward: Callable) -> dict[str, Any]:
    """Arguments that keep the probe to the head: no cache, no router outputs."""
    names = inspect.signature(forward).parameters
    return {k: v for k, v in (("use_cache", False), ("output_router_logits", False)) if k in names}
