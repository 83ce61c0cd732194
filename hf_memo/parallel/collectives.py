"""The two collectives sequence parallelism needs, plain and differentiable.

- :func:`all_to_all`: split a tensor along one dimension, send piece ``j`` to rank ``j`` of the group,
  concatenate what arrives (in rank order) along another dimension. Ulysses uses it to trade a
  sequence shard of every head for the whole sequence of some heads, and back.
- :func:`sum_over_group`: all-reduce (sum) whose backward all-reduces the gradient too, so every rank
  of the group back-propagates the same global loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all over ``group`` (``n`` ranks), without autograd.

    ``x`` is cut into ``n`` equal pieces along ``scatter_dim``; piece ``j`` goes to rank ``j``. The
    pieces received from ranks ``0..n-1`` are concatenated along ``gather_dim``. So the result's
    ``scatter_dim`` is ``n`` times smaller and its ``gather_dim`` ``n`` times larger than ``x``'s.
    ``x.shape[scatter_dim]`` must be a multiple of ``n``; every rank passes the same shape.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return x
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.shape[scatter_dim] % size != 0:
        raise ValueError(f"all_to_all: dimension {scatter_dim} of shape {tuple(x.shape)} is not divisible by {size}")
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all_differentiable(
    x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """:func:`all_to_all` with autograd: the backward is the inverse all-to-all of the gradient."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


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
