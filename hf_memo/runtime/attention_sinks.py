"""Attention sinks composed with any attention kernel's output and log-sum-exp, forward and backward.

A sink (gpt-oss) is a learned per-head logit ``s_h`` that joins every query's softmax denominator and takes no
value. For a kernel's ``out_i = sum_j p_ij v_j`` with ``p_ij = exp(t_ij - lse_i)``, the same attention with the sink
is ``lse'_i = logaddexp(lse_i, s_h)`` and ``out'_i = out_i * exp(lse_i - lse'_i)`` (:func:`apply_sinks_`). Its
backward is the kernel's own backward run on ``(out', lse')``: every kernel recomputes ``p'_ij = exp(t_ij - lse'_i)``,
the sink attention's probabilities, and ``D'_i = rowsum(dO_i * out'_i)``, its ``sum_j p'_ij dP_ij`` (the sink has no
value, so it adds nothing; dropout scales ``out'`` and ``dP`` alike). The sinks' own gradient is
``dL/ds_h = -sum_{b,i} exp(s_h - lse'_{b,h,i}) * D'_{b,h,i}`` (:func:`sinks_grad`).

So every kernel (the CPU and CUDA flash kernels, flash-attn, the memory-efficient kernel, the explicit one)
serves a layer with sinks unchanged, at the cost of one pass over the output in each direction.
"""

from __future__ import annotations

import torch

ROW_BLOCK_ELEMENTS = 1 << 24  # elements of grad_out read per block by sinks_grad, in its compute dtype


@torch.no_grad()
def apply_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Turn one kernel call's ``out`` ``(B, h, S, D)`` and ``lse`` ``(B, h, S)`` into those of the same attention
    with ``sinks`` ``(h,)``, in place (any strides; ``out`` is rounded once to its dtype)."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])
    out.mul_(torch.exp(lse - total)[..., None])
    lse.copy_(total)


@torch.no_grad()
def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The ``(h,)`` gradient of ``sinks`` in their dtype, from the sink attention's ``grad_out``, ``out``
    ``(B, h, S, D)`` and ``lse`` ``(B, h, S)`` (those :func:`apply_sinks_` wrote); row dots in ``lse``'s dtype."""
    batch, heads, seq, dim = out.shape
    rows = max(1, ROW_BLOCK_ELEMENTS // max(1, batch * heads * dim))
    sink = sinks.to(lse.dtype)[:, None]
    grad = torch.zeros(heads, dtype=lse.dtype, device=lse.device)
    for start in range(0, seq, rows):
        part = slice(None), slice(None), slice(start, start + rows)
        dots = (grad_out[part].to(lse.dtype) * out[part].to(lse.dtype)).sum(-1)  # D' (B, h, r)
        grad -= (torch.exp(sink - lse[part]) * dots).sum((0, 2))
    return grad.to(sinks.dtype)
