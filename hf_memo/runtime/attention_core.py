"""Causal attention as an explicit forward/backward pair, so backward never recomputes attention.

``forward`` returns the output and the softmax statistics its backward needs; ``backward`` takes
them back. Backends: PyTorch's flash kernels (CPU, and CUDA for fp16/bf16), PyTorch's memory-
efficient kernel (CUDA, other dtypes), and the ``flash-attn`` package when it is importable on CUDA.
Grouped-query attention expands K/V to the query heads for the call and sums dK/dV back per group.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

_ops = torch.ops.aten


@dataclass
class AttentionStats:
    """What one backend's backward needs besides ``q, k, v`` and the output: ``lse`` is ``(B, h, S)``."""

    lse: torch.Tensor
    extra: tuple[Any, ...] = ()


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, h_kv, S, D) -> (B, h_kv * groups, S, D)``: kv head ``j`` serves query heads ``j*groups ...``."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def reduce_kv(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`expand_kv` for gradients: ``(B, h_kv * groups, S, D) -> (B, h_kv, S, D)`` (sum)."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


def backend_for(q: torch.Tensor) -> str:
    """The kernel used for ``q``: ``"cpu-flash"``, ``"flash-attn"``, ``"cuda-flash"`` or ``"cuda-efficient"``."""
    if q.device.type == "cpu":
        return "cpu-flash"
    if q.device.type != "cuda":
        raise ValueError(f"the memo attention core supports cpu and cuda tensors, got {q.device.type}")
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half and importlib.util.find_spec("flash_attn") is not None:
        return "flash-attn"
    return "cuda-flash" if half else "cuda-efficient"


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would run in: the autocast dtype under autocast (it casts SDPA's inputs), else the inputs'."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, AttentionStats]:
    """Causal attention output ``(B, h, S, D)`` and its statistics, building no autograd graph.

    Args:
        q: ``(B, h, S, D)`` queries; k, v: ``(B, h_kv, S, D)`` with ``h % h_kv == 0``. Under autocast
            they are cast to the autocast dtype first, as ``scaled_dot_product_attention`` would be.
        scale: softmax scale (usually ``D ** -0.5``).
    """
    dtype = _compute_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    groups = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, groups), expand_kv(v, groups)
    backend = backend_for(q)
    with torch.no_grad():
        if backend == "cpu-flash":
            out, lse = _ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
            return out, AttentionStats(lse)
        if backend == "flash-attn":
            from flash_attn.flash_attn_interface import _flash_attn_forward

            result = _flash_attn_forward(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, scale, True, -1, -1, 0.0, None, False
            )
            out, lse = result[0], result[1]
            return out.transpose(1, 2), AttentionStats(lse)
        if backend == "cuda-flash":
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _ops._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, False, scale=scale
            )
            return out, AttentionStats(lse, (cum_q, cum_k, max_q, max_k, seed, offset))
        out, lse, seed, offset = _ops._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, True, scale=scale
        )
        return out, AttentionStats(lse, (seed, offset))


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: AttentionStats,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of causal attention from its saved output and statistics.

    Shapes as in :func:`attention_forward`; ``dk, dv`` come back with ``h_kv`` heads, and each gradient
    in the dtype of its input (the backward of the forward's cast).
    """
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, grad_out = (t.to(out.dtype) for t in (q, k, v, grad_out))
    groups = q.shape[1] // k.shape[1]
    ke, ve = expand_kv(k, groups), expand_kv(v, groups)
    backend = backend_for(q)
    grad_out = grad_out.contiguous()
    if backend == "cpu-flash":
        dq, dk, dv = _ops._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, ke, ve, out, stats.lse, 0.0, True, scale=scale
        )
    elif backend == "flash-attn":
        from flash_attn.flash_attn_interface import _flash_attn_backward

        dq, dk, dv = (torch.empty_like(t.transpose(1, 2)) for t in (q, ke, ve))
        _flash_attn_backward(
            grad_out.transpose(1, 2),
            q.transpose(1, 2),
            ke.transpose(1, 2),
            ve.transpose(1, 2),
            out.transpose(1, 2),
            stats.lse,
            dq,
            dk,
            dv,
            0.0,
            scale,
            True,
            -1,
            -1,
            0.0,
            None,
            False,
            None,
        )
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    elif backend == "cuda-flash":
        cum_q, cum_k, max_q, max_k, seed, offset = stats.extra
        dq, dk, dv = _ops._scaled_dot_product_flash_attention_backward(
            grad_out, q, ke, ve, out, stats.lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
        )
    else:
        seed, offset = stats.extra
        dq, dk, dv, _ = _ops._scaled_dot_product_efficient_attention_backward(
            grad_out, q, ke, ve, None, out, stats.lse, seed, offset, 0.0, [True, True, True, False], True, scale=scale
        )
    grads = (dq, reduce_kv(dk, groups), reduce_kv(dv, groups))
    return tuple(g.to(dtype) for g, dtype in zip(grads, dtypes))


class LocalAttention:
    """The attention core on this device's whole sequence: :func:`attention_forward` / :func:`attention_backward`.

    The memo executor calls a core through this two-method interface; sequence parallelism swaps in
    one that exchanges heads for the sequence around these calls.
    """

    forward = staticmethod(attention_forward)
    backward = staticmethod(attention_backward)
