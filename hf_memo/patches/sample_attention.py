"""Per-sample attention in training steps: an attention implementation wrapping the model's own (``sdpa``, flash).

:func:`install_sample_attention` points every attention layer at it (through an
:class:`~hf_memo.parallel.attention.AttentionConfigView`, so the model's config stays as it is). In a
training step the causal LM's forward hands the step's
:class:`~hf_memo.runtime.batch_layout.BatchLayout` down under ``LAYOUT_KEYWORD``, and each sample is
one causal call of the wrapped implementation: samples never attend to each other, padding costs
nothing, and transformers needs to build no ``S x S`` mask. Recomputations (``recompute="full"``,
``"selective"``, Hugging Face checkpointing) get the layout again with the layer's arguments. Any
other call runs the wrapped implementation with transformers' own mask.

A layer's attention keywords (scaling, dropout, ``sliding_window``, ``softcap``, ``s_aux``) reach each call as
they are, so each sample gets what the wrapped implementation computes for it. ``sdpa`` applies a sliding window
only through the mask transformers builds, so for samples longer than the window
:func:`~hf_memo.parallel.attention.sdpa_with_window` computes the windowed attention with hf_memo's attention
core (no ``S x S`` mask, ``O(S * window)``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_memo.parallel.attention import WRAPPABLE, AttentionConfigView, InnerModuleView, sdpa_with_window
from hf_memo.parallel.causal_lm import attention_modules
from hf_memo.runtime.batch_layout import LAYOUT_KEYWORD
from hf_memo.runtime.varlen_attention import attend_per_sample

_INSTALLED = "_hf_memo_sample_attention"


def sample_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    inner: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``inner`` per sample of the step's layout (``(B, h, S, D)`` q, ``(B, h_kv, S, D)`` k/v -> ``(B, S, h, D)``).

    Without a layout in ``kwargs`` (evaluation, generation, calls without labels), or with one whose
    padding attends (``padding_attends``: transformers' masks give that padding its attention), ``inner``
    runs with ``attention_mask`` as transformers built it.
    """
    attend = ALL_ATTENTION_FUNCTIONS[inner]
    layout = kwargs.pop(LAYOUT_KEYWORD, None)
    view = InnerModuleView(module, inner)
    if layout is None or layout.padding_attends:
        return attend(view, query, key, value, attention_mask, **kwargs)
    if inner == "sdpa":
        attend = sdpa_with_window
    return attend_per_sample(attend, view, query, key, value, layout, kwargs), None


@functools.cache
def register_sample_attention(inner: str) -> str:
    """Register :func:`sample_attention` wrapping ``inner`` (once); return its ``AttentionInterface`` key."""
    name = f"hf_memo_samples_{inner.replace('flash_attention_', 'fa')}"
    AttentionInterface.register(name, functools.partial(sample_attention, inner=inner))
    return name


def install_sample_attention(model: PreTrainedModel, record: Any) -> None:
    """Point ``model``'s attention layers at :func:`sample_attention` when its implementation can be wrapped.

    ``record`` (a :class:`~hf_memo.patches.installed.PatchRecord`) keeps what to restore. Other
    implementations (``eager``, ``flex_attention``) keep transformers' masks, which handle padded and
    packed batches too (at ``S x S`` cost).
    """
    inner = model.config.get_text_config()._attn_implementation
    if inner not in WRAPPABLE:
        return
    name = register_sample_attention(inner)
    for layer in attention_modules(model):
        record.set(layer, "config", AttentionConfigView(layer.config, name))
    record.set(model, _INSTALLED, True)


def attends_per_sample(model: PreTrainedModel) -> bool:
    """Whether :func:`install_sample_attention` wrapped ``model``'s attention."""
    return bool(model.__dict__.get(_INSTALLED, False))


def uninstall_sample_attention(model: PreTrainedModel, record: Any) -> None:
    """Undo :func:`install_sample_attention`: the attention layers use transformers' masks again."""
    record.undo_attribute("config")
    record.undo_attribute(_INSTALLED)
