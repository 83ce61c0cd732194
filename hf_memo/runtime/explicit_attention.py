"""Exact attention as explicit blockwise math, for what no kernel of the device computes: a forward/backward pair.

It computes causal (or, ``causal=False``, all-to-all) softmax attention with any of a sliding window, logit
soft-capping and dropout (:class:`~hf_memo.runtime.attention_traits.AttentionTraits`), on any device and
dtype, with plain torch ops (so it also runs under ``FakeTensorMode``), in the input dtype (fp64 stays
fp64) or fp32 for lower precision. :mod:`.attention_core` runs it where no kernel serves: on the CPU
whenever dropout, a window or soft-capping is on, and on CUDA for soft-capping without flash-attn or a
window outside the flash kernels' dtypes. It is the one explicit implementation: attention dropout on the
CPU runs here too, its mask regenerated from a seed (:func:`~hf_memo.runtime.dropout_attention.keep_mask`).
Sinks are not its business: :mod:`.attention_sinks` composes them with every kernel's output, this one's
included, so the traits it takes carry none.

Per block of ``r`` query rows ``[start, stop)`` (the ``g = h / h_kv`` query heads of a KV head stacked as
``g * r`` rows against that head's keys, so K/V are never expanded):

* keys: ``[start - window + 1, stop)`` with a window (transformers' rule: query ``i`` sees key ``j`` where
  ``i - window < j <= i``), ``[0, stop)`` without, every key when not causal: a window costs ``O(S * window)``;
* forward: scores ``t = cap(scale * q k^T)`` with ``cap(s) = softcap * tanh(s / softcap)``, masked, their
  ``lse``, ``out = (P * keep / (1 - p)) @ V`` with ``P = exp(t - lse)``;
* backward: ``t`` and ``P`` recomputed from ``lse`` (as flash attention does), ``dV += (P * keep / (1 - p))^T dO``,
  ``dP = (dO V^T) * keep / (1 - p)``, ``dT = P * (dP - rowsum(dO * O))``, ``dS = dT * (1 - tanh^2)`` under
  soft-capping, ``dQ = scale * dS K`` written per block, ``dK += scale * dS^T Q`` accumulated.

Transient memory: a block holds at most :data:`BLOCK_ELEMENTS` scores (``B * h * r * keys``). It is the
correctness path, not a fast kernel: plain causal attention without dropout never comes here.
"""

from __future__ import annotations

import math

import torch

from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.dropout_attention import keep_mask

BLOCK_ELEMENTS = 1 << 22  # scores per block (B * h * rows * keys); 32 MiB per fp64 temporary


def _block_rows(batch: int, heads: int, seq: int, keys: int, window: int | None) -> int:
    """Query rows per block: at most :data:`BLOCK_ELEMENTS` scores, a block of ``r`` rows reading ``keys`` keys,
    or ``r + window - 1`` with a window."""
    budget = max(1, BLOCK_ELEMENTS // max(1, batch * heads))
    if window is None:
        rows = budget // max(1, keys)
    else:  # the largest r with r * (r + window - 1) <= budget
        reach = window - 1
        rows = (math.isqrt(reach * reach + 4 * budget) - reach) // 2
    return max(1, min(seq, rows))


def _stack_groups(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, h, r, X) -> (B, h_kv, g * r, X)``: the query heads of each KV head as one block of rows."""
    b, h, r, x = t.shape
    return t.reshape(b, kv_heads, (h // kv_heads) * r, x)


def _unstack_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`_stack_groups`: ``(B, h_kv, g * r, X) -> (B, h, r, X)``."""
    b, _, rows, x = t.shape
    return t.reshape(b, heads, rows * t.shape[1] // heads, x)


def _checked(traits: AttentionTraits, causal: bool) -> AttentionTraits:
    if traits.sinks is not None:
        raise ValueError("explicit attention computes no sinks: attention_sinks composes them with its output")
    if traits.window is not None and not causal:
        raise ValueError("a sliding window is relative to the query's position: it needs causal attention")
    return traits


class _Block:
    """Capped, masked scores and kept mask of query rows ``[start, stop)`` (stacked per KV head) against the keys
    ``[lo, hi)`` they may attend to."""

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, start: int, stop: int, traits: AttentionTraits, seed: int, causal: bool
    ) -> None:
        batch, heads, seq, _ = q.shape
        kv_heads, window = k.shape[1], traits.window
        self.lo = 0 if not causal or window is None else max(0, start - window + 1)
        self.hi = stop if causal else k.shape[2]
        self.q = _stack_groups(q[:, :, start:stop], kv_heads)  # (B, h_kv, g * r, D)
        self.k = k[:, :, self.lo : self.hi]
        scores = self.q @ self.k.transpose(-1, -2) * traits.scale  # (B, h_kv, g * r, keys)
        self.tanh = None
        if traits.softcap is not None:
            self.tanh = torch.tanh(scores / traits.softcap)
            scores = self.tanh * traits.softcap
        if causal:
            query_pos = torch.arange(start, stop, device=q.device).repeat(heads // kv_heads)[:, None]
            key_pos = torch.arange(self.lo, self.hi, device=q.device)
            hidden = key_pos > query_pos
            if window is not None:
                hidden |= key_pos <= query_pos - window
            scores = scores.masked_fill(hidden, -torch.inf)
        self.scores = scores
        self.keep = None
        p = traits.dropout_p
        if p > 0:
            mask = keep_mask(seed, p, batch, heads, max(seq, k.shape[2]), (start, stop), self.hi, q.device, self.lo)
            self.keep = _stack_groups(mask, kv_heads).to(scores.dtype) / (1.0 - p)  # kept entries scaled by 1/(1-p)

    def dropped(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs`` after dropout (scaled by ``1 / (1 - p)``), or as they are without."""
        return probs if self.keep is None else probs * self.keep


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _blocks(q: torch.Tensor, k: torch.Tensor, traits: AttentionTraits, causal: bool) -> list[tuple[int, int]]:
    """The ``[start, stop)`` query rows of every block."""
    batch, heads, seq, _ = q.shape
    rows = _block_rows(batch, heads, seq, k.shape[2], traits.window if causal else None)
    return [(start, min(seq, start + rows)) for start in range(0, seq, rows)]


def explicit_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits, seed: int = 0, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``out`` ``(B, h, S, D_v)`` in ``q``'s dtype, and ``lse`` ``(B, h, S)`` in fp32 (fp64 for fp64 inputs).

    Args:
        q: ``(B, h, S, D)``; k: ``(B, h_kv, S_k, D)``, v: ``(B, h_kv, S_k, D_v)``, ``h % h_kv == 0``, any strides.
        traits: scale, dropout, window, soft-cap (no sinks).
        seed: the dropout mask's seed (:func:`~hf_memo.runtime.dropout_attention.draw_seed`), unused without dropout.
        causal: ``False``: every query attends to every key (no window), and ``S_k`` may differ from ``S``.
    """
    traits = _checked(traits, causal)
    batch, heads, seq, _ = q.shape
    work = _compute_dtype(q.dtype)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    out = q.new_empty(*q.shape[:-1], v.shape[-1]) if v.shape[-1] != q.shape[-1] else torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, dtype=work, device=q.device)
    for start, stop in _blocks(q, k, traits, causal):
        block = _Block(qw, kw, start, stop, traits, seed, causal)
        block_lse = torch.logsumexp(block.scores, dim=-1, keepdim=True)
        probs = block.dropped(torch.exp(block.scores - block_lse))
        o = probs @ vw[:, :, block.lo : block.hi]
        out[:, :, start:stop] = _unstack_groups(o, heads).to(q.dtype)
        lse[:, :, start:stop] = _unstack_groups(block_lse, heads)[..., 0]
    return out, lse


def explicit_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    traits: AttentionTraits,
    seed: int = 0,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`explicit_forward` with the same ``traits``, ``seed`` and ``causal``, each in its
    input's layout and dtype (shapes as in the forward); ``out`` and ``lse`` are the forward's."""
    traits = _checked(traits, causal)
    heads, kv_heads = q.shape[1], k.shape[1]
    work = _compute_dtype(q.dtype)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=work, device=k.device)
    dv = torch.zeros(v.shape, dtype=work, device=v.device)
    for start, stop in _blocks(q, k, traits, causal):
        block = _Block(qw, kw, start, stop, traits, seed, causal)
        keys = slice(block.lo, block.hi)
        probs = torch.exp(block.scores - _stack_groups(lse[:, :, start:stop, None].to(work), kv_heads))
        d_out = _stack_groups(grad_out[:, :, start:stop].to(work), kv_heads)
        o = _stack_groups(out[:, :, start:stop].to(work), kv_heads)
        dv[:, :, keys] += block.dropped(probs).transpose(-1, -2) @ d_out
        d_probs = block.dropped(d_out @ vw[:, :, keys].transpose(-1, -2))
        d_scores = probs * (d_probs - (d_out * o).sum(-1, keepdim=True))
        if block.tanh is not None:
            d_scores = d_scores * (1 - block.tanh.square())
        dq[:, :, start:stop] = _unstack_groups(d_scores @ block.k * traits.scale, heads).to(q.dtype)
        dk[:, :, keys] += d_scores.transpose(-1, -2) @ block.q * traits.scale
    return dq, dk.to(k.dtype), dv.to(v.dtype)
