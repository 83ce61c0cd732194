"""What a causal LM does to its head's output before the loss: logit scales and final soft-capping.

hf_memo's loss runs the head per mini-sequence, so it must apply the same transform per chunk. The
transform is read from the model's traits (Granite's ``logits_scaling``, Cohere's ``logit_scale``, Gemma's
``final_logit_softcapping``) and then checked against the model's own forward (:func:`check_logit_transform`):
an unknown transform is refused, never silently dropped.
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


def _checkable(weight: torch.Tensor) -> bool:
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


def check_logit_transform(model: PreTrainedModel, forward: Callable, transform: LogitTransform) -> None:
    """Check ``transform(head(h))`` against the logits of ``forward`` (the model's own forward) on random hidden
    states ``h`` ``(1, 3, H)`` fed to it in place of the backbone's output.

    Skipped where the head holds no values here (meta, fake, partitioned).

    Raises:
        ValueError: they differ: the model transforms its logits in a way hf_memo does not know.
    """
    head = model.get_output_embeddings()
    weight = head.weight
    if not _checkable(weight):
        return
    hidden_size = weight.shape[-1]
    generator = torch.Generator(device=weight.device).manual_seed(0)
    hidden = torch.randn(1, 3, hidden_size, generator=generator, device=weight.device).to(weight.dtype)
    modes = {module: module.training for module in model.modules()}
    backbone = getattr(model, model.base_model_prefix)
    model.eval()
    try:
        with torch.no_grad(), _backbone_returning(backbone, hidden):
            logits = forward(input_ids=torch.zeros(1, 3, dtype=torch.long, device=weight.device), **_quiet(forward))
            expected = logits.logits if hasattr(logits, "logits") else logits[0]
            got = transform(head(hidden))
    finally:
        for module, training in modes.items():
            module.training = training
    tolerance = 1e-6 if weight.dtype in (torch.float32, torch.float64) else 1e-2
    if expected.shape != got.shape or not torch.allclose(expected.float(), got.float(), rtol=tolerance, atol=tolerance):
        worst = (expected.float() - got.float()).abs().max().item() if expected.shape == got.shape else float("nan")
        raise ValueError(
            f"hf_memo cannot patch {type(model).__name__} (model_type {model.config.model_type!r}): its logits are "
            f"not its head's output with the transforms hf_memo knows (found: {transform.describe()}; largest "
            f"difference {worst:.3g}), so its loss per mini-sequence would differ"
        )


def _quiet(forward: Callable) -> dict[str, Any]:
    """Arguments that keep the probe to the head: no cache, no router outputs."""
    names = inspect.signature(forward).parameters
    return {k: v for k, v in (("use_cache", False), ("output_router_logits", False)) if k in names}
