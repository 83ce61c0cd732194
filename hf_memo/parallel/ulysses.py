"""DeepSpeed-Ulysses head/sequence exchange at any degree, with and without autograd.

Every rank of a sequence-parallel group of ``P`` ranks holds a contiguous shard of ``s = S / P`` tokens. Before
attention, :func:`scatter_heads_gather_sequence` gives each rank the *whole* sequence of some heads (rank ``j``
the heads ``ranges[j]`` of a :class:`~hf_memo.parallel.heads.HeadSplit`: its query heads for q, the KV heads they
use for k and v, ranges that may differ in length and, for KV heads, overlap); attention runs unchanged on that;
:func:`gather_heads_scatter_sequence` brings a result back to every head of the rank's own tokens, adding up what
several ranks return for one head (the gradient of a KV head sent to several ranks). Each is the other's adjoint,
so the ``*_differentiable`` versions' backward is the other exchange. :func:`repeat_kv_heads` makes one KV head per
query head after the exchange where a split asks for it, and :func:`sum_repeated_kv_heads` is its gradient.

Shapes: the heads and sequence dimensions are ``heads_dim`` and ``seq_dim`` (``(B, heads, S, D)`` by default,
``(B, S, heads, D)`` for an attention output with ``heads_dim=2, seq_dim=1``). The plain functions (no autograd)
are for code that calls an attention core as an explicit forward/backward pair; the others are for autograd.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hf_memo.parallel.collectives import all_to_all_slices
from hf_memo.parallel.heads import HeadSplit

_HEADS, _SEQUENCE = 1, 2


def _rank(group: dist.ProcessGroup | None, size: int) -> int:
    return dist.get_rank(group) if size > 1 else 0


def scatter_heads_gather_sequence(
    x: torch.Tensor,
    ranges: Sequence[range],
    group: dist.ProcessGroup | None,
    heads_dim: int = _HEADS,
    seq_dim: int = _SEQUENCE,
) -> torch.Tensor:
    """``(B, h, s, D)`` -> ``(B, len(ranges[r]), P * s, D)`` on rank ``r`` of the ``P = len(ranges)`` ranks of
    ``group``: heads ``ranges[j]`` of every rank's tokens go to rank ``j``, in rank order along the sequence (no
    autograd). Every rank passes the same shape."""
    size = len(ranges)
    if size == 1:
        return x
    mine = list(x.shape)
    mine[heads_dim] = len(ranges[_rank(group, size)])
    received = all_to_all_slices(x, heads_dim, ranges, [math.prod(mine)] * size, group)
    return received.view(size, *mine).movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)


def gather_heads_scatter_sequence(
    x: torch.Tensor,
    ranges: Sequence[range],
    heads: int,
    group: dist.ProcessGroup | None,
    heads_dim: int = _HEADS,
    seq_dim: int = _SEQUENCE,
) -> torch.Tensor:
    """``(B, len(ranges[r]), P * s, D)`` -> ``(B, heads, s, D)``: the adjoint of :func:`scatter_heads_gather_sequence`
    (no autograd). Rank ``j``'s heads ``ranges[j]`` of this rank's tokens land at their place; where ranges overlap,
    the ranks' values are added up."""
    size = len(ranges)
    if size == 1:
        return x
    shard = x.shape[seq_dim] // size
    tokens = [range(j * shard, (j + 1) * shard) for j in range(size)]
    piece = list(x.shape)
    piece[seq_dim] = shard
    counts = [math.prod(piece) // piece[heads_dim] * len(r) for r in ranges]
    received = all_to_all_slices(x, seq_dim, tokens, counts, group)
    whole = [*piece[:heads_dim], heads, *piece[heads_dim + 1 :]]
    partition = all(r.start == (ranges[i - 1].stop if i else 0) for i, r in enumerate(ranges))
    if partition and math.prod(whole[:heads_dim]) == 1:
        return received.view(whole)
    out = x.new_empty(whole) if partition else x.new_zeros(whole)
    for start, count, r in zip(itertools.accumulate([0, *counts]), counts, ranges):
        piece[heads_dim] = len(r)
        place = out.narrow(heads_dim, r.start, len(r))
        part = received[start : start + count].view(piece)
        if partition:
            place.copy_(part)
        else:
            place.add_(part)
    return out


class _ScatterHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ranges: Sequence[range], group, heads_dim: int, seq_dim: int) -> torch.Tensor:
        ctx.exchange = (ranges, x.shape[heads_dim], group, heads_dim, seq_dim)
        return scatter_heads_gather_sequence(x, ranges, group, heads_dim, seq_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return gather_heads_scatter_sequence(grad, *ctx.exchange), None, None, None, None


class _GatherHeads(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, ranges: Sequence[range], heads: int, group, heads_dim: int, seq_dim: int
    ) -> torch.Tensor:
        ctx.exchange = (ranges, group, heads_dim, seq_dim)
        return gather_heads_scatter_sequence(x, ranges, heads, group, heads_dim, seq_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return scatter_heads_gather_sequence(grad, *ctx.exchange), None, None, None, None, None


def scatter_heads_gather_sequence_differentiable(
    x: torch.Tensor,
    ranges: Sequence[range],
    group: dist.ProcessGroup | None,
    heads_dim: int = _HEADS,
    seq_dim: int = _SEQUENCE,
) -> torch.Tensor:
    """:func:`scatter_heads_gather_sequence` with autograd (its backward is :func:`gather_heads_scatter_sequence`)."""
    return _ScatterHeads.apply(x, ranges, group, heads_dim, seq_dim)


def gather_heads_scatter_sequence_differentiable(
    x: torch.Tensor,
    ranges: Sequence[range],
    heads: int,
    group: dist.ProcessGroup | None,
    heads_dim: int = _HEADS,
    seq_dim: int = _SEQUENCE,
) -> torch.Tensor:
    """:func:`gather_heads_scatter_sequence` with autograd (its backward is :func:`scatter_heads_gather_sequence`)."""
    return _GatherHeads.apply(x, ranges, heads, group, heads_dim, seq_dim)


def repeat_kv_heads(x: torch.Tensor, split: HeadSplit, rank: int) -> torch.Tensor:
    """``(B, kv_r, S, D)`` -> ``(B, split.attended_kv_heads(rank), S, D)``: rank ``rank``'s received KV heads, each
    repeated for the query heads that use it where ``split`` asks for one KV head per query head (else ``x``).
    Differentiable (autograd sums the copies)."""
    repeats = split.kv_repeats(rank)
    if repeats is None:
        return x
    return torch.cat([x.narrow(_HEADS, i, 1).expand(-1, n, -1, -1) for i, n in enumerate(repeats)], _HEADS)


def sum_repeated_kv_heads(grad: torch.Tensor, split: HeadSplit, rank: int) -> torch.Tensor:
    """``(B, split.attended_kv_heads(rank), S, D)`` -> ``(B, kv_r, S, D)``: the gradient of :func:`repeat_kv_heads`
    (each KV head's copies summed)."""
    repeats = split.kv_repeats(rank)
    if repeats is None:
        return grad
    total = grad.new_empty(grad.shape[0], len(repeats), *grad.shape[2:])
    for i, copies in enumerate(grad.split(repeats, _HEADS)):
        torch.sum(copies, _HEADS, keepdim=True, out=total.narrow(_HEADS, i, 1))
    return total
