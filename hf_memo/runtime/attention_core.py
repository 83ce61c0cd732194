"""Causal attention as an explicit forward/backward pair, so backward never recomputes attention.

``causal=False`` attends every query to every key (``q`` and ``k`` may then differ in length): the
block of padding queries after a sample that attend to all of its tokens (see
:meth:`~hf_memo.runtime.batch_layout.BatchLayout.blocks`).

Each call takes the layer's :class:`~hf_memo.runtime.attention_traits.AttentionTraits` (scale, dropout,
sliding window, logit soft-cap, sinks). ``forward`` returns the output and the statistics its backward
needs (softmax ``lse``, dropout probability and what replays the dropout mask); ``backward`` takes them
back and returns ``(dq, dk, dv, dsinks)``. Backends (:func:`select_backend`):

* ``"cpu-flash"``: PyTorch's CPU flash kernel: plain causal attention without dropout;
* ``"explicit"``: explicit blockwise math (:mod:`.explicit_attention`, dropout with a regenerated mask): on
  the CPU for dropout, a window or soft-capping; on CUDA for what no kernel there computes (soft-capping
  without flash-attn, a window or soft-cap outside the flash kernels' dtypes and head sizes);
* ``"flash-attn"``: the ``flash-attn`` package (:mod:`.flash_attn_package`), CUDA fp16/bf16, window and
  soft-cap included;
* ``"cuda-flash"``: PyTorch's CUDA flash kernel, fp16/bf16, when flash-attn is not usable; a window reaches
  it through ``_flash_attention_forward``'s ``window_size_left``;
* ``"cuda-efficient"``: PyTorch's memory-efficient kernel, plain attention in other dtypes and head sizes.

A window that hides no key (``window >= S``, :func:`kernel_window`) is no window: plain attention's
kernels run. Sinks are composed with every backend's ``(out, lse)`` (:mod:`.attention_sinks`), so they
never decide the backend.

On CUDA the kernels draw dropout from the device generator's Philox stream and return its seed and
offset (flash-attn: ``rng_state``), which the backward passes back to replay the same mask.

Layout: every kernel takes strided ``(B, h, S, D)`` views with a unit last stride, and the flash
kernels allocate their output like ``q``. The executor therefore hands in views of ``(B, S, h, D)``
memory, so the output's rows ``(B, S, h * D)`` are a view, never a second copy.

Grouped-query attention (``h_kv < h``): the flash kernels (PyTorch's CUDA flash, flash-attn) and the
explicit path take K/V with ``h_kv`` heads; PyTorch's CPU flash kernel does so where a probe of it finds that it
does (:func:`~hf_memo.profiler.kernel_workspace.cpu_flash_takes_grouped_kv`: every release from 2.11 to 2.14);
the memory-efficient kernel requires equal head counts, so K/V are expanded for it (and for a CPU flash kernel
that refuses them) and dK/dV summed back per group (:func:`needs_kv_expansion`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_memo.profiler.kernel_workspace import (
    CPU,
    PROFILED_TARGET,
    KernelTarget,
    flash_eligible,
    needs_kv_expansion,
)
from hf_memo.runtime import flash_attn_package
from hf_memo.runtime.attention_sinks import apply_sinks_, sinks_grad
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.dropout_attention import draw_seed
from hf_memo.runtime.explicit_attention import explicit_backward, explicit_forward

_ops = torch.ops.aten


@dataclass
class AttentionStats:
    """What one backend's backward needs besides ``q, k, v`` and the output.

    Attributes:
        lse: ``(B, h, S)`` log-sum-exp of each query's scaled (soft-capped) scores, the sinks included
            (the memory-efficient kernel pads ``S`` to a multiple of 32).
        extra: backend state, e.g. the dropout RNG's seed/offset (CUDA) or mask seed (explicit).
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
    *,
    windowed: bool = False,
    softcapped: bool = False,
    flash_attn: bool | None = None,
    value_head_dim: int | None = None,
) -> str:
    """The kernel for attention on ``device_type`` in ``dtype`` with head size ``head_dim``.

    Args:
        capability: the CUDA device's compute capability (flash kernels need 8.0 or newer).
        windowed: a sliding window hides some key (see :func:`kernel_window`).
        softcapped: the scores are soft-capped.
        flash_attn: whether the flash-attn package is there (default: importable in this process).
        value_head_dim: the values' head size where it is not ``head_dim`` (multi-head latent attention, several
            value heads per query head side by side), which the flash kernels do not take.
    """
    other_values = value_head_dim is not None and value_head_dim != head_dim
    if device_type == "cpu":
        return "explicit" if dropout_p > 0 or windowed or softcapped or other_values else "cpu-flash"
    if device_type != "cuda":
        raise ValueError(f"the memo attention core supports cpu and cuda tensors, got {device_type}")
    if other_values or not flash_eligible(dtype, head_dim, capability):
        return "explicit" if windowed or softcapped else "cuda-efficient"
    if softcapped and dropout_p > 0:  # flash-attn refuses a soft-cap with dropout; PyTorch's kernels have no soft-cap
        return "explicit"
    if flash_attn if flash_attn is not None else flash_attn_package.flash_attn_interface() is not None:
        return "flash-attn"
    return "explicit" if softcapped else "cuda-flash"


def kernel_window(traits: AttentionTraits, length: int, causal: bool = True) -> int | None:
    """The sliding window a kernel must apply to ``length`` queries: ``traits.window``, or ``None`` where it hides
    no key (``window >= length``: query ``i`` sees keys ``i - window < j <= i``).

    Raises:
        ValueError: a window that hides keys in a non-causal call (it is relative to causal positions).
    """
    window = traits.window
    if window is None or (causal and window >= length):
        return None
    if not causal:
        raise ValueError("a sliding window is relative to the query's position: it needs causal attention")
    return window


def backend_for(
    q: torch.Tensor, traits: AttentionTraits, causal: bool = True, value_head_dim: int | None = None
) -> str:
    """The kernel :func:`attention_forward` uses for ``q`` ``(B, h, S, D)`` with ``traits`` and values of head size
    ``value_head_dim`` (default ``D``) (:func:`select_backend`).

    In a fake profile recorded for a CUDA target (:data:`~hf_memo.profiler.kernel_workspace.PROFILED_TARGET`), the
    target's choice: where it is a CUDA kernel, PyTorch's CPU flash op stands in for it (the same outputs; the
    recorder adds the kernel's workspace), whatever window or soft-cap the kernel takes; where it is the explicit
    kernel, that kernel runs, its block temporaries being what the GPU would hold.
    """
    windowed, softcapped = kernel_window(traits, q.shape[2], causal) is not None, traits.softcap is not None
    target = PROFILED_TARGET.get()
    if target is not None and target.device == "cuda" and q.device.type == "cpu" and is_fake(q):
        chosen = select_backend(
            "cuda", q.dtype, q.shape[-1], traits.dropout_p, target.capability,
            windowed=windowed, softcapped=softcapped, flash_attn=target.flash_attn, value_head_dim=value_head_dim,
        )  # fmt: skip
        return "explicit" if chosen == "explicit" else "cpu-flash"
    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    return select_backend(
        q.device.type, q.dtype, q.shape[-1], traits.dropout_p, capability,
        windowed=windowed, softcapped=softcapped, value_head_dim=value_head_dim,
    )  # fmt: skip


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would run in: the autocast dtype under autocast (it casts SDPA's inputs), else the inputs'."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def flash_window(window: int | None) -> dict[str, int | None]:
    """PyTorch's flash kernels' window arguments: ``window - 1`` keys before each query, none after (causal)."""
    return {"window_size_left": None if window is None else window - 1, "window_size_right": 0}


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits, causal: bool = True
) -> tuple[torch.Tensor, AttentionStats]:
    """Causal attention output ``(B, h, S, D)`` (laid out like ``q``) and its statistics, building no graph.

    Args:
        q: ``(B, h, S, D)`` queries; k, v: ``(B, h_kv, S, D)`` with ``h % h_kv == 0``; unit last stride.
            Under autocast they are cast to the autocast dtype first, as ``scaled_dot_product_attention``
            would be.
        traits: scale (usually ``D ** -0.5``), dropout probability (training, as in SDPA), sliding window,
            soft-cap and sinks of the layer's attention. Sinks are composed with the kernel's result
            (:mod:`.attention_sinks`): the statistics' ``lse`` includes them.
        causal: ``False``: every query attends to every key (no window), and k, v may hold ``S_k != S`` tokens.
    """
    dtype = compute_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    backend = backend_for(q, traits, causal, v.shape[-1])
    window = kernel_window(traits, q.shape[2], causal)
    if needs_kv_expansion(backend):
        groups = q.shape[1] // k.shape[1]
        k, v = expand_kv(k, groups), expand_kv(v, groups)
    with torch.no_grad():
        out, stats = _kernel_forward(backend, q, k, v, traits, window, causal)
        if traits.sinks is not None:
            apply_sinks_(out, stats.lse[..., : q.shape[2]], traits.sinks)  # the efficient kernel pads lse
    return out, stats


def _kernel_forward(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    traits: AttentionTraits,
    window: int | None,
    causal: bool,
) -> tuple[torch.Tensor, AttentionStats]:
    """``backend``'s output and statistics, without sinks (shapes as in :func:`attention_forward`)."""
    scale, p = traits.scale, traits.dropout_p
    if backend == "cpu-flash":
        out, lse = _ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, AttentionStats(lse)
    if backend == "explicit":
        seed = draw_seed() if p > 0 else 0
        kernel_traits = AttentionTraits(scale, p, window, traits.softcap)
        out, lse = explicit_forward(q, k, v, kernel_traits, seed, causal)
        return out, AttentionStats(lse, (seed,), p)
    if backend == "flash-attn":
        fa = flash_attn_package.flash_attn_interface()
        out, lse, rng_state = flash_attn_package.forward(
            fa, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, p, causal, window, traits.softcap
        )
        return out.transpose(1, 2), AttentionStats(lse, (rng_state,), p)
    if backend == "cuda-flash" and window is not None:  # the window reaches the kernel through its own entry point
        out, lse, rng_state, unused, _ = _ops._flash_attention_forward(
            *(t.transpose(1, 2) for t in (q, k, v)),
            None,
            None,
            q.shape[2],
            k.shape[2],
            p,
            causal,
            False,
            scale=scale,
            **flash_window(window),
        )
        return out.transpose(1, 2), AttentionStats(lse, (rng_state, unused), p)
    if backend == "cuda-flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _ops._scaled_dot_product_flash_attention(
            q, k, v, p, causal, False, scale=scale
        )
        return out, AttentionStats(lse, (cum_q, cum_k, max_q, max_k, seed, offset), p)
    out, lse, seed, offset = _ops._scaled_dot_product_efficient_attention(q, k, v, None, True, p, causal, scale=scale)
    return out, AttentionStats(lse, (seed, offset), p)


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: AttentionStats,
    traits: AttentionTraits,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients ``(dq, dk, dv, dsinks)`` of attention from its saved output and statistics.

    Shapes, ``traits`` and ``causal`` as in :func:`attention_forward`; the dropout mask of the forward is replayed
    from ``stats``. ``dk, dv`` come back with ``h_kv`` heads, and each gradient in the dtype of its input (the
    backward of the forward's cast); ``dsinks`` is the ``(h,)`` gradient of ``traits.sinks`` (``None`` without).
    """
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, grad_out = (t.to(out.dtype) for t in (q, k, v, grad_out))
    backend = backend_for(q, traits, causal, v.shape[-1])
    window = kernel_window(traits, q.shape[2], causal)
    groups = q.shape[1] // k.shape[1] if needs_kv_expansion(backend) else 1
    k, v = expand_kv(k, groups), expand_kv(v, groups)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv = _kernel_backward(backend, grad_out, q, k, v, out, stats, traits, window, causal)
    grads = (dq, reduce_kv(dk, groups), reduce_kv(dv, groups))
    dq, dk, dv = (g.to(dtype) for g, dtype in zip(grads, dtypes))
    if traits.sinks is None:
        return dq, dk, dv, None
    return dq, dk, dv, sinks_grad(grad_out, out, stats.lse[..., : q.shape[2]], traits.sinks)


def _kernel_backward(
    backend: str,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: AttentionStats,
    traits: AttentionTraits,
    window: int | None,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backend``'s ``(dq, dk, dv)`` (``dk, dv`` with the heads ``k, v`` have) from :func:`_kernel_forward`'s
    statistics; with sinks, ``out`` and ``stats.lse`` are those of the sink attention (see :mod:`.attention_sinks`)."""
    scale, p = traits.scale, stats.dropout_p
    if backend == "cpu-flash":
        return _ops._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, stats.lse, 0.0, causal, scale=scale
        )
    if backend == "explicit":
        (seed,) = stats.extra
        kernel_traits = AttentionTraits(scale, p, window, traits.softcap)
        return explicit_backward(grad_out, q, k, v, out, stats.lse, kernel_traits, seed, causal)
    if backend == "flash-attn":
        (rng_state,) = stats.extra
        grads = flash_attn_package.backward(
            flash_attn_package.flash_attn_interface(),
            *(t.transpose(1, 2) for t in (grad_out, q, k, v, out)),
            stats.lse,
            rng_state,
            scale,
            p,
            causal,
            window,
            traits.softcap,
        )
        return tuple(g.transpose(1, 2) for g in grads)
    if backend == "cuda-flash" and window is not None:
        rng_state, unused = stats.extra
        grads = _ops._flash_attention_backward(
            *(t.transpose(1, 2) for t in (grad_out, q, k, v, out)),
            stats.lse,
            None,
            None,
            q.shape[2],
            k.shape[2],
            p,
            causal,
            rng_state,
            unused,
            scale=scale,
            **flash_window(window),
        )
        return tuple(g.transpose(1, 2) for g in grads)
    if backend == "cuda-flash":
        cum_q, cum_k, max_q, max_k, seed, offset = stats.extra
        return _ops._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, stats.lse, cum_q, cum_k, max_q, max_k, p, causal, seed, offset, scale=scale
        )
    seed, offset = stats.extra
    dq, dk, dv, _ = _ops._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, stats.lse, seed, offset, p, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


class LocalAttention:
    """The attention core on this device's whole sequence: :func:`attention_forward` / :func:`attention_backward`.

    The memo executor calls a core through this two-method interface (``forward(q, k, v, traits)``,
    ``backward(grad_out, q, k, v, out, stats, traits)``); sequence parallelism swaps in one that exchanges
    heads for the sequence around these calls.
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
