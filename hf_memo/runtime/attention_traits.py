"""`AttentionTraits`: what one decoder layer's attention computes besides plain causal softmax attention.

A model's attention module hands them to transformers' attention interface as keyword arguments
(``scaling``, ``dropout``, ``sliding_window``, ``softcap``, ``s_aux``); hf_memo reads them from that call
(see :mod:`hf_memo.patches.layer_split`), so every layer gets its own (Gemma's alternating windows,
gpt-oss's sinks), and every attention path (the memo core on CPU and CUDA, per-sample attention,
sequence parallelism) computes the same function as the model's own implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class AttentionTraits:
    """One layer's attention function.

    Attributes:
        scale: the factor on ``q @ k^T`` (the module's ``scaling``).
        dropout_p: attention dropout probability of this call (0 outside training).
        window: transformers' ``sliding_window``: query ``i`` attends key ``j`` only where
            ``i - window < j <= i`` (``None``: all earlier keys).
        softcap: attention logit soft-capping: scores ``s`` (after ``scale``) become
            ``softcap * tanh(s / softcap)`` before the softmax (``None``: no capping).
        sinks: ``(h,)`` learned per-head sink logits (gpt-oss's ``sinks`` parameter, a leaf that may need a
            gradient): each query's softmax denominator gains ``exp(sinks[head])``, which takes no value.
    """

    scale: float
    dropout_p: float = 0.0
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Whether this is plain causal attention (no window, soft-cap or sinks): every kernel computes it."""
        return self.window is None and self.softcap is None and self.sinks is None


def traits_of_call(kwargs: Mapping[str, Any], head_dim: int) -> AttentionTraits:
    """The traits an attention module's call of transformers' attention interface asks for, from the call's keyword
    arguments: ``scaling`` (``head_dim ** -0.5`` where missing), ``dropout``, ``sliding_window``, ``softcap`` and
    ``s_aux`` (the sinks)."""
    scale = kwargs.get("scaling")
    return AttentionTraits(
        head_dim**-0.5 if scale is None else float(scale),
        float(kwargs.get("dropout") or 0.0),
        kwargs.get("sliding_window"),
        kwargs.get("softcap"),
        kwargs.get("s_aux"),
    )
