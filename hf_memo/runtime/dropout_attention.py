"""Causal attention with dropout on the CPU, as a forward/backward pair that regenerates its dropout mask.

PyTorch's CPU flash kernel has no dropout, and the memo executor must differentiate attention later
without running it again, so the CPU path with ``dropout_p > 0`` is explicit math over blocks of query
rows, in the input dtype (fp64 stays fp64) or fp32 for lower precision:

* the dropout mask is *counter based*: whether the probability of query ``i`` attending to key ``j`` in
  head ``n`` of sequence ``b`` is kept is a hash of ``(seed, b, n, i, j)`` (:func:`keep_mask`). The
  forward draws ``seed`` from PyTorch's CPU generator (so ``torch.manual_seed`` reproduces a step and
  every call draws a fresh mask) and keeps only that integer; the backward regenerates the mask of
  each block from it. The mask never depends on the block sizes, and no ``(S, S)`` tensor is kept.
* forward per block of ``r`` query rows: scores against keys ``[0, stop)``, causal mask, softmax
  statistics ``lse``, ``out = (P * keep / (1 - p)) @ V``. Backward per block: the scores and ``P`` are
  recomputed from ``lse`` (as flash attention does), ``dV += (P * keep / (1 - p))^T dO``,
  ``dP = (dO V^T) * keep / (1 - p)``, ``dS = P * (dP - rowsum(dO * O))``, ``dQ = scale * dS K``,
  ``dK += scale * dS^T Q``.
* grouped-query attention: the ``g = h / h_kv`` query heads of a KV head are stacked as ``g * r`` rows
  against that head's keys, so K/V are never expanded.

Cost: the FLOPs of two attention forwards plus the hash (about ten integer operations per score) in
each direction; transient memory ``O(B h r S)`` per block with ``r`` chosen so a block holds at most
:data:`BLOCK_ELEMENTS` scores. It is the correctness path of a CPU run, not a fast kernel.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

BLOCK_ELEMENTS = 1 << 22  # scores per block (B * h * rows * keys); 32 MiB per fp64 temporary
_MASK32 = 0xFFFFFFFF


def draw_seed() -> int:
    """A fresh 32-bit mask seed from PyTorch's default CPU generator (advances it like a dropout call).

    Under ``FakeTensorMode`` (memory profiling, e.g. the planner's fake step) no value exists and none
    matters: the seed is 0.
    """
    seed = torch.randint(0, 1 << 32, (), dtype=torch.int64)
    return 0 if is_fake(seed) else int(seed)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without overflowing int64 (16-bit halves)."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift / multiply rounds) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keep_mask(
    seed: int, p: float, batch: int, heads: int, seq: int, rows: tuple[int, int], keys: int, device: torch.device
) -> torch.Tensor:
    """Which attention probabilities survive dropout: ``(B, h, stop - start, keys)`` bool for query rows
    ``rows = (start, stop)`` against keys ``[0, keys)`` of a ``seq``-token causal self-attention.

    Each element is kept with probability ``1 - p`` independently of the others, as a function of
    ``(seed, b, n, i, j)`` only: any block of the ``(B, h, S, S)`` mask is the same slice of the whole.
    """
    start, stop = rows
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    n = torch.arange(heads, device=device).view(1, -1, 1, 1)
    i = torch.arange(start, stop, device=device).view(1, 1, -1, 1)
    j = torch.arange(keys, device=device).view(1, 1, 1, -1)
    counter = ((b * heads + n) * seq + i) * seq + j  # unique per element, < 2**63 for any real shape
    bits = _mix32((counter & _MASK32) ^ _mix32((counter >> 32) ^ (seed & _MASK32)))
    return bits >= int(round(p * (1 << 32)))


def _block_rows(batch: int, heads: int, seq: int) -> int:
    return max(1, min(seq, BLOCK_ELEMENTS // max(1, batch * heads * seq)))


def _stack_groups(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, h, r, X) -> (B, h_kv, g * r, X)``: the query heads of each KV head as one block of rows."""
    b, h, r, x = t.shape
    return t.reshape(b, kv_heads, (h // kv_heads) * r, x)


def _unstack_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`_stack_groups`: ``(B, h_kv, g * r, X) -> (B, h, r, X)``."""
    b, _, rows, x = t.shape
    return t.reshape(b, heads, rows * t.shape[1] // heads, x)


class _Block:
    """Scores, probabilities and kept mask of query rows ``[start, stop)`` (stacked per KV head)."""

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, start: int, stop: int, scale: float, p: float, seed: int, causal: bool
    ):
        batch, heads, seq, _ = q.shape
        kv_heads = k.shape[1]
        self.keys = stop if causal else k.shape[2]  # keys [0, keys) some query of the block attends to
        self.q = _stack_groups(q[:, :, start:stop], kv_heads)  # (B, h_kv, g * r, D)
        self.k = k[:, :, : self.keys]
        self.scores = self.q @ self.k.transpose(-1, -2) * scale  # (B, h_kv, g * r, keys)
        if causal:
            query_pos = torch.arange(start, stop, device=q.device).repeat(heads // kv_heads)
            self.scores = self.scores.masked_fill(torch.arange(stop, device=q.device) > query_pos[:, None], -torch.inf)
        mask = keep_mask(seed, p, batch, heads, max(seq, self.keys), (start, stop), self.keys, q.device)
        self.keep = _stack_groups(mask, kv_heads).to(self.scores.dtype) / (1.0 - p)  # kept entries scaled by 1/(1-p)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def dropout_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, p: float, seed: int, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention with dropout: ``out`` in ``q``'s layout and dtype, ``lse (B, h, S)``.

    Args:
        q: ``(B, h, S, D)``; k, v: ``(B, h_kv, S, D)``, ``h % h_kv == 0``, any strides.
        p: dropout probability in ``(0, 1)``; seed: the mask seed (:func:`draw_seed`).
        causal: ``False``: every query attends to every key, and k, v may hold ``S_k != S`` tokens.
    """
    batch, heads, seq, _ = q.shape
    work = _compute_dtype(q.dtype)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, dtype=work, device=q.device)
    rows = _block_rows(batch, heads, max(seq, k.shape[2]))
    for start in range(0, seq, rows):
        stop = min(seq, start + rows)
        block = _Block(qw, kw, start, stop, scale, p, seed, causal)
        block_lse = torch.logsumexp(block.scores, dim=-1, keepdim=True)
        probs = torch.exp(block.scores - block_lse)
        o = (probs * block.keep) @ vw[:, :, : block.keys]
        out[:, :, start:stop] = _unstack_groups(o, heads).to(q.dtype)
        lse[:, :, start:stop] = _unstack_groups(block_lse, heads)[..., 0]
    return out, lse


def dropout_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    p: float,
    seed: int,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`dropout_attention_forward` with the same ``p``, ``seed`` and ``causal``, each in
    its input's layout and dtype (shapes as in the forward)."""
    batch, heads, seq, _ = q.shape
    kv_heads = k.shape[1]
    work = _compute_dtype(q.dtype)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=work, device=k.device)
    dv = torch.zeros(v.shape, dtype=work, device=v.device)
    rows = _block_rows(batch, heads, max(seq, k.shape[2]))
    for start in range(0, seq, rows):
        stop = min(seq, start + rows)
        block = _Block(qw, kw, start, stop, scale, p, seed, causal)
        keys = block.keys
        block_lse = _stack_groups(lse[:, :, start:stop, None].to(work), kv_heads)
        probs = torch.exp(block.scores - block_lse)
        dropped = probs * block.keep
        d_out = _stack_groups(grad_out[:, :, start:stop].to(work), kv_heads)
        o = _stack_groups(out[:, :, start:stop].to(work), kv_heads)
        dv[:, :, :keys] += dropped.transpose(-1, -2) @ d_out
        d_probs = (d_out @ vw[:, :, :keys].transpose(-1, -2)) * block.keep
        d_scores = probs * (d_probs - (d_out * o).sum(-1, keepdim=True))
        dq[:, :, start:stop] = _unstack_groups(d_scores @ block.k * scale, heads).to(q.dtype)
        dk[:, :, :keys] += d_scores.transpose(-1, -2) @ block.q * scale
    return dq, dk.to(k.dtype), dv.to(v.dtype)
