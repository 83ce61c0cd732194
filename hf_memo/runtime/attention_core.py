"""Causal attention as an explicit forward/backward pair, so backward never recomputes attention.

``causal=False`` attends every query to every key (``q`` and ``k`` may then differ in length): the
block of padding queries after a sample that attend to all of its tokens (see
:meth:`~hf_memo.runtime.batch_layout.BatchLayout.blocks`).

``forward`` returns the output and the statistics its backward needs (softmax ``lse``, dropout
probability and what replays the dropout mask); ``backward`` takes them back. Backends
(:func:`select_backend`):

* ``"cpu-flash"``: PyTorch's CPU flash kernel (no dropout);
* ``"cpu-dropout"``: explicit blockwise math with a regenerated mask (:mod:`.dropout_attention`), on
  the CPU when ``dropout_p > 0``;
* ``"flash-attn"``: the ``flash-attn`` package (:mod:`.flash_attn_package`), CUDA fp16/bf16;
* ``"cuda-flash"``: PyTorch's CUDA flash kernel, fp16/bf16, when flash-attn is not usable;
* ``"cuda-efficient"``: PyTorch's memory-efficient kernel, other dtypes and head sizes.

On CUDA the kernels draw dropout from the device generator's Philox stream and return its seed and
offset (flash-attn: ``rng_state``), which the backward passes back to replay the same mask.

Layout: every kernel takes strided ``(B, h, S, D)`` views with a unit last stride, and the flash
kernels allocate their output like ``q``. The executor therefore hands in views of ``(B, S, h, D)``
memory, so the output's rows ``(B, S, h * D)`` are a view, never a second copy.

Grouped-query attention (``h_kv < h``): the flash kernels (PyTorch's CUDA flash, flash-attn) and the
CPU dropout path take K/V with ``h_kv`` heads; PyTorch's CPU flash kernel does so from torch 2.13 (checked
here against explicit math, forward and backward); the memory-efficient kernel requires equal head counts,
so K/V are expanded for it and dK/dV summed back per group (:func:`needs_kv_expansion`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_memo.profiler.kernel_workspace import CPU, KernelTarget, flash_eligible, needs_kv_expansion
from hf_memo.runtime import flash_attn_package
from hf_memo.runtime.dropout_attention import draw_seed, dropout_attention_backward, dropout_attention_forward

_ops = torch.ops.aten


@dataclass
class AttentionStats:
    """What one backend's backward needs besides ``q, k, v`` and the output.

    Attributes:
        lse: ``(B, h, S)`` log-sum-exp of each query's scaled scores.
        extra: backend state, e.g. the dropout RNG's seed/offset (CUDA) or mask seed (CPU).
        dropout_p: the attention dropout probability the forward applied.
    """

    lse: torch.Tensor
    extra: tuple[Any, ...] = ()
    dropout_p: float = 0.0


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


def select_backend(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    dropout_p: float = 0.0,
    capability: tuple[int, int] | None = None,
) -> str:
    """The kernel for attention on ``device_type`` in ``dtype`` with head size ``head_dim``.

    Args:
        capability: the CUDA device's compute capability (flash kernels need 8.0 or newer).
    """
    if device_type == "cpu":
        return "cpu-dropout" if dropout_p > 0 else "cpu-flash"
    if device_type != "cuda":
        raise ValueError(f"the memo attention core supports cpu and cuda tensors, got {device_type}")
    if not flash_eligible(dtype, head_dim, capability):
        return "cuda-efficient"
    return "flash-attn" if flash_attn_package.flash_attn_interface() is not None else "cuda-flash"


def backend_for(q: torch.Tensor, dropout_p: float = 0.0) -> str:
    """The kernel :func:`attention_forward` uses for ``q`` ``(B, h, S, D)`` (see :func:`select_backend`)."""
    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    return select_backend(q.device.type, q.dtype, q.shape[-1], dropout_p, capability)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would run in: the autocast dtype under autocast (it casts SDPA's inputs), else the inputs'."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float = 0.0, causal: bool = True
) -> tuple[torch.Tensor, AttentionStats]:
    """Causal attention output ``(B, h, S, D)`` (laid out like ``q``) and its statistics, building no graph.

    Args:
        q: ``(B, h, S, D)`` queries; k, v: ``(B, h_kv, S, D)`` with ``h % h_kv == 0``; unit last stride.
            Under autocast they are cast to the autocast dtype first, as ``scaled_dot_product_attention``
            would be.
        scale: softmax scale (usually ``D ** -0.5``).
        dropout_p: probability of dropping an attention probability (training), as in SDPA.
        causal: ``False``: every query attends to every key, and k, v may hold ``S_k != S`` tokens.
    """
    dtype = compute_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    backend = backend_for(q, dropout_p)
    if needs_kv_expansion(backend):
        groups = q.shape[1] // k.shape[1]
        k, v = expand_kv(k, groups), expand_kv(v, groups)
    with torch.no_grad():
        if backend == "cpu-flash":
            out, lse = _ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out, AttentionStats(lse)
        if backend == "cpu-dropout":
            seed = draw_seed()
            out, lse = dropout_attention_forward(q, k, v, scale, dropout_p, seed, causal)
            return out, AttentionStats(lse, (seed,), dropout_p)
        if backend == "flash-attn":
            fa = flash_attn_package.flash_attn_interface()
            out, lse, rng_state = flash_attn_package.forward(
                fa, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, dropout_p, causal
            )
            return out.transpose(1, 2), AttentionStats(lse, (rng_state,), dropout_p)
        if backend == "cuda-flash":
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _ops._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, causal, False, scale=scale
            )
            return out, AttentionStats(lse, (cum_q, cum_k, max_q, max_k, seed, offset), dropout_p)
        out, lse, seed, offset = _ops._scaled_dot_product_efficient_attention(
            q, k, v, None, True, dropout_p, causal, scale=scale
        )
        return out, AttentionStats(lse, (seed, offset), dropout_p)


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: AttentionStats,
    scale: float,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of causal attention from its saved output and statistics.

    Shapes and ``causal`` as in :func:`attention_forward`; the dropout mask of the forward is replayed from ``stats``.
    ``dk, dv`` come back with ``h_kv`` heads, and each gradient in the dtype of its input (the backward
    of the forward's cast).
    """
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, grad_out = (t.to(out.dtype) for t in (q, k, v, grad_out))
    p = stats.dropout_p
    backend = backend_for(q, p)
    groups = q.shape[1] // k.shape[1] if needs_kv_expansion(backend) else 1
    k, v = expand_kv(k, groups), expand_kv(v, groups)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if backend == "cpu-flash":
        dq, dk, dv = _ops._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, stats.lse, 0.0, causal, scale=scale
        )
    elif backend == "cpu-dropout":
        (seed,) = stats.extra
        dq, dk, dv = dropout_attention_backward(grad_out, q, k, v, out, stats.lse, scale, p, seed, causal)
    elif backend == "flash-attn":
        (rng_state,) = stats.extra
        dq, dk, dv = flash_attn_package.backward(
            flash_attn_package.flash_attn_interface(),
            *(t.transpose(1, 2) for t in (grad_out, q, k, v, out)),
            stats.lse,
            rng_state,
            scale,
            p,
            causal,
        )
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    elif backend == "cuda-flash":
        cum_q, cum_k, max_q, max_k, seed, offset = stats.extra
        dq, dk, dv = _ops._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, stats.lse, cum_q, cum_k, max_q, max_k, p, causal, seed, offset, scale=scale
        )
    else:
        seed, offset = stats.extra
        dq, dk, dv, _ = _ops._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, stats.lse, seed, offset, p, [True, True, True, False], causal, scale=scale
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


def device_target(device: torch.device) -> KernelTarget:
    """The kernels a real model on ``device`` runs, for its fake profiles: its GPU as it is (this process's
    flash-attn), or the CPU (no workspace modelled)."""
    if device.type != "cuda":
        return CPU
    properties = torch.cuda.get_device_properties(device)
    return KernelTarget(
        "cuda",
        (properties.major, properties.minor),
        flash_attn_package.flash_attn_interface() is not None,
        properties.multi_processor_count,
    )
