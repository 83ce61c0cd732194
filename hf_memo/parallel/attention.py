"""Ulysses attention as a ``transformers`` attention implementation, wrapping ``sdpa`` or flash-attention.

:func:`register_ulysses_attention` adds an entry to ``transformers``' ``AttentionInterface``; an
attention layer whose config (an :class:`AttentionConfigView`) names it runs through
:func:`ulysses_attention`, whatever its family: the layer's own q/k/v (``(B, h, S / sp, D)``, this
rank's tokens) are exchanged for the whole sequence of the rank's heads (its
:class:`~hf_memo.parallel.heads.HeadSplit`'s: ``⌈h/sp⌉`` or ``⌊h/sp⌋`` query heads and the KV heads they use),
the wrapped implementation runs on them, and the output is exchanged back to ``(B, S / sp, h, D)``. Outside
training the wrapped implementation runs directly, with the model's own mask.

The layer's attention keywords reach the wrapped implementation as they are (``sliding_window`` and
``softcap`` apply within each whole sequence a rank holds), except the sinks (gpt-oss's ``s_aux``, one per
query head), which are sliced to this rank's heads (their gradient: this rank's contribution, zero for the
other heads). ``sdpa`` takes a sliding window only through an ``S x S`` mask, so where the window hides keys
:func:`sdpa_with_window` computes it with hf_memo's attention core instead.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_memo.parallel.groups import sequence_parallel_groups
from hf_memo.parallel.heads import HeadSplit
from hf_memo.parallel.ulysses import (
    gather_heads_scatter_sequence_differentiable,
    repeat_kv_heads,
    scatter_heads_gather_sequence_differentiable,
)
from hf_memo.runtime.attention_function import core_attention
from hf_memo.runtime.attention_traits import traits_of_call
from hf_memo.runtime.batch_layout import LAYOUT_KEYWORD, BatchLayout
from hf_memo.runtime.varlen_attention import attend_per_sample

WRAPPABLE = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
SEQUENCE_PARALLEL = (*WRAPPABLE, "eager")


def check_wrappable(implementation: str | None) -> None:
    """Ulysses wraps an attention that is causal without a mask (``sdpa``, flash-attention) or the model's eager
    attention (its causal calls run hf_memo's attention core); ``ValueError`` otherwise."""
    if implementation not in SEQUENCE_PARALLEL:
        raise ValueError(
            f"sequence parallelism needs the model's attn_implementation to be one of {', '.join(SEQUENCE_PARALLEL)}, "
            f"got {implementation!r} (load the model with attn_implementation='sdpa')"
        )


def _implementation(module: nn.Module, name: str) -> Callable:
    """The attention function ``name`` names for ``module``: transformers' registry, or for ``"eager"`` the
    ``eager_attention_forward`` of the module's own modeling file (what the module falls back to)."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def causal_with_traits(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """What a model's eager attention computes for a causal call, without the mask it needs (one sample of the whole
    sequences after Ulysses' exchange): hf_memo's attention core with the call's scale, sliding window, soft-cap and
    sinks (``s_aux``), differentiable (:func:`~hf_memo.runtime.attention_function.core_attention`). Its dropout mask
    is the core's, not eager's.

    Args:
        query: ``(B, h, S, D)``; key, value: ``(B, h_kv, S, D)``.

    Returns:
        ``((B, S, h, D), None)``.
    """
    return core_attention(query, key, value, traits_of_call(kwargs, query.shape[-1])).transpose(1, 2), None


class AttentionConfigView:
    """A model config seen through one attention module: the same, except for ``_attn_implementation``.

    Sequence parallelism puts one on each attention module, naming Ulysses, so only attention
    dispatch changes: the model's config, its masks and any other model sharing the config stay as
    they are. Ulysses hands the wrapped implementation a view naming that implementation (flash-attention
    reads the name).
    """

    def __init__(self, config: Any, implementation: str) -> None:
        self._config = config
        self._attn_implementation = implementation

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_config":  # copying and pickling look these up before __init__
            raise AttributeError(name)
        return getattr(self._config, name)


class InnerModuleView:
    """An attention module as the wrapped implementation must see it: its config names that implementation
    and, after the exchange, ``num_key_value_groups`` counts this rank's query heads per KV head (KV
    replication changes it). Everything else is the module's own."""

    def __init__(self, module: nn.Module, implementation: str, kv_groups: int | None = None) -> None:
        self._module = module
        self.config = AttentionConfigView(module.config, implementation)
        if kv_groups is not None:
            self.num_key_value_groups = kv_groups

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_module":
            raise AttributeError(name)
        return getattr(self._module, name)


def sdpa_with_window(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention for a causal call without a mask, its ``sliding_window`` applied.

    transformers builds a sliding-window mask for ``sdpa``; a call without one (a sample of per-sample attention,
    the whole sequences after Ulysses' exchange) would attend beyond the window. Where the window hides keys
    (more queries than ``sliding_window``), hf_memo's attention core computes what ``sdpa`` computes with that
    mask, in ``O(S * window)``, differentiable (:func:`~hf_memo.runtime.attention_function.core_attention`); as
    ``sdpa``, it computes no sinks. Any other call is ``sdpa``'s.

    Args:
        query: ``(B, h, S, D)``; key, value: ``(B, h_kv, S, D)``.
        kwargs: ``scaling``, ``dropout``, ``sliding_window`` and whatever else ``sdpa`` takes.

    Returns:
        ``((B, S, h, D), None)``.
    """
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    window = kwargs.get("sliding_window")
    if attention_mask is not None or window is None or query.shape[2] <= window or kwargs.get("softcap") is not None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)  # sdpa refuses a soft-cap itself
    traits = replace(traits_of_call(kwargs, query.shape[-1]), sinks=None)  # as sdpa: no sinks
    return core_attention(query, key, value, traits).transpose(1, 2), None


def _rank_sinks(kwargs: dict[str, Any], heads: range) -> dict[str, Any]:
    """``kwargs`` with the sinks (``s_aux``, ``(h,)``) sliced to this rank's query ``heads``."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        return kwargs
    return {**kwargs, "s_aux": sinks[heads.start : heads.stop]}


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    inner: str,
    sp_size: int,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention of this rank's tokens against the whole sequence, via two all-to-alls.

    Args:
        module: the attention layer (its ``is_causal``, ``layer_idx``, config, ...).
        query: ``(B, h, S / sp, D)``; key, value: ``(B, kv, S / sp, D)`` for this rank's tokens.
        attention_mask: ignored in training: after the exchange the rows attend per sample of the
            step's :class:`~hf_memo.runtime.batch_layout.BatchLayout` (in ``kwargs`` under
            ``LAYOUT_KEYWORD``; padding left out).
        inner: the wrapped implementation (``"sdpa"``, a flash-attention one, or ``"eager"``: the model's own
            outside training, :func:`causal_with_traits` in it).
        sp_size: the sequence-parallel degree.
        **kwargs: passed to the wrapped implementation (dropout, scaling, sliding_window, ...).

    Returns:
        ``((B, S / sp, h, D), None)``, as every ``transformers`` attention implementation returns.
        Outside training the wrapped implementation runs unsplit.
    """
    layout = kwargs.pop(LAYOUT_KEYWORD, None)
    if not module.training:
        return _implementation(module, inner)(
            InnerModuleView(module, inner), query, key, value, attention_mask, **kwargs
        )
    attend = {"sdpa": sdpa_with_window, "eager": causal_with_traits}.get(inner) or ALL_ATTENTION_FUNCTIONS[inner]
    groups = sequence_parallel_groups(sp_size)
    group, rank, heads = groups.group, groups.sp_rank, query.shape[1]
    split = HeadSplit(heads, key.shape[1], sp_size)
    kwargs = _rank_sinks(kwargs, split.query(rank))
    query = scatter_heads_gather_sequence_differentiable(query, split.queries, group)
    key, value = (
        repeat_kv_heads(scatter_heads_gather_sequence_differentiable(x, split.kvs, group), split, rank)
        for x in (key, value)
    )
    view = InnerModuleView(module, inner, kv_groups=query.shape[1] // key.shape[1])
    if layout is None:
        layout = BatchLayout(query.shape[2])
    output = attend_per_sample(attend, view, query, key, value, layout, kwargs)  # (B, S, h_r, D)
    return gather_heads_scatter_sequence_differentiable(output, split.queries, heads, group, 2, 1), None


def ulysses_attention_name(inner: str, sp_size: int) -> str:
    """The ``AttentionInterface`` key of Ulysses over ``sp_size`` ranks wrapping ``inner``."""
    return f"hf_memo_ulysses_sp{sp_size}_{inner.replace('flash_attention_', 'fa')}"


@functools.cache
def register_ulysses_attention(inner: str, sp_size: int) -> str:
    """Register Ulysses attention wrapping ``inner`` for degree ``sp_size`` (once); return its key."""
    check_wrappable(inner)
    name = ulysses_attention_name(inner, sp_size)
    AttentionInterface.register(name, functools.partial(ulysses_attention, inner=inner, sp_size=sp_size))
    return name
