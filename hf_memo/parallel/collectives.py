"""The two collectives sequence parallelism needs, plain and differentiable.

- :func:`all_to_all_slices`: send slice ``j`` of a tensor (along one dimension, any sizes) to rank ``j`` of the
  group and receive what the others send, in rank order. Ulysses uses it to trade a sequence shard of every head
  for the whole sequence of some heads, and back.
- :func:`sum_over_group`: all-reduce (sum) whose backward all-reduces the gradient too, so every rank
  of the group back-propagates the same global loss.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist


def all_to_all_slices(
    x: torch.Tensor, dim: int, ranges: Sequence[range], receive: Sequence[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """All-to-all of slices of ``x`` over the ``n`` ranks of ``group``, sizes free (no autograd).

    Rank ``j`` gets ``x.narrow(dim, r.start, len(r))`` for ``r = ranges[j]`` (ranges may differ in length and
    overlap); the result is the flat concatenation of what arrives from ranks ``0..n-1``, ``receive[i]`` elements
    from rank ``i``, each piece laid out contiguously in its own shape. What is sent is packed into one buffer, or
    is ``x`` itself where ``x`` is contiguous and its slices tile it in order.
    """
    pieces = [x.narrow(dim, r.start, len(r)) for r in ranges]
    sizes = [piece.numel() for piece in pieces]
    tiled = all(r.start == (ranges[i - 1].stop if i else 0) for i, r in enumerate(ranges))
    if x.is_contiguous() and tiled and ranges[-1].stop == x.shape[dim] and math.prod(x.shape[:dim]) == 1:
        send = x.view(-1)
    else:
        send = x.new_empty(sum(sizes))
        for piece, start, size in zip(pieces, itertools.accumulate([0, *sizes]), sizes):
            send[start : start + size].view(piece.shape).copy_(piece)
    received = x.new_empty(sum(receive))
    dist.all_to_all_single(received, send, list(receive), sizes, group=group)
    return received


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group``, differentiable.

    Backward all-reduces the gradient as well: when every rank back-propagates the same summed
    value, each rank's ``x`` gets the group size times its true gradient, which the data-parallel
    average over the world (DDP, DeepSpeed) divides back out.
    """
    return _SumOverGroup.apply(x, group)


def all_gather_tensor(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(n, *x.shape)``: ``x`` from every rank of ``group``, in rank order (no autograd)."""
    size = dist.get_world_size(group)
    gathered = x.new_empty(size * x.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(gathered, x.contiguous().view(-1), group=group)
    return gathered.view(size, *x.shape)
