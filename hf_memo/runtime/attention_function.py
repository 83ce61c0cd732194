"""The attention core (:mod:`.attention_core`) as an autograd function, for code that differentiates with autograd.

Per-sample attention and Ulysses in the non-memo modes call the model's attention implementation with
autograd; where that implementation cannot compute a layer's traits without an ``S x S`` mask (PyTorch's SDPA
and a sliding window), they call this instead: the core's kernels (a windowed flash kernel on CUDA, the explicit
kernel on the CPU) in forward, its backward pair in backward. The dropout mask is the core's (replayed from its
statistics; a recomputation under restored RNG state, as checkpointing does, draws it again).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hf_memo.runtime.attention_core import attention_backward, attention_forward
from hf_memo.runtime.attention_traits import AttentionTraits


class _CoreAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, traits):
        out, stats = attention_forward(q, k, v, traits)
        ctx.save_for_backward(q, k, v, out, stats.lse)
        ctx.stats, ctx.traits = replace(stats, lse=None), traits
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, dsinks = attention_backward(grad_out, q, k, v, out, replace(ctx.stats, lse=lse), ctx.traits)
        return dq, dk, dv, dsinks, None


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits) -> torch.Tensor:
    """Causal attention with ``traits``, differentiable in ``q, k, v`` and ``traits.sinks``.

    Args:
        q: ``(B, h, S, D)``; k, v: ``(B, h_kv, S, D)`` with ``h % h_kv == 0``.

    Returns:
        ``(B, h, S, D)``, laid out like ``q``.
    """
    return _CoreAttention.apply(q, k, v, traits.sinks, traits)
