"""DeepSpeed-Ulysses head/sequence exchange on ``(B, heads, S, D)`` tensors, with and without autograd.

Every rank of a sequence-parallel group of ``sp`` ranks holds a contiguous shard of ``S / sp``
tokens. Before attention, :func:`scatter_heads_gather_sequence` gives each rank the *whole*
sequence for ``heads / sp`` of the heads (rank ``r`` gets heads ``[r * heads / sp, (r + 1) * heads / sp)``);
attention runs unchanged on that; :func:`gather_heads_scatter_sequence` brings the output back to
all heads of the rank's own tokens.

Grouped-query attention: with ``kv_heads >= sp`` (``sp`` dividing ``kv_heads``), rank ``r`` receives
KV heads ``[r * kv_heads / sp, ...)``, exactly the ones its query heads use. With ``sp > kv_heads``
(``sp`` a multiple of ``kv_heads``), :func:`replicate_kv_heads` first repeats every KV head
``sp / kv_heads`` times, so each rank receives the one KV head its query heads use; in backward,
:func:`sum_replicated_kv_heads` adds the copies' gradients back together.

The plain functions (no autograd) are for code that calls an attention core as an explicit
forward/backward pair; the ``*_differentiable`` ones are for autograd.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_memo.parallel.collectives import all_to_all, all_to_all_differentiable

_HEADS, _SEQUENCE = 1, 2


def scatter_heads_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, h, S / sp, D)`` -> ``(B, h / sp, S, D)`` over the ``sp`` ranks of ``group`` (no autograd).

    ``h`` must be a multiple of ``sp`` (replicate KV heads first when it is not).
    """
    return all_to_all(x, group, scatter_dim=_HEADS, gather_dim=_SEQUENCE)


def gather_heads_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, h / sp, S, D)`` -> ``(B, h, S / sp, D)``: the inverse of :func:`scatter_heads_gather_sequence`."""
    return all_to_all(x, group, scatter_dim=_SEQUENCE, gather_dim=_HEADS)


def scatter_heads_gather_sequence_differentiable(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """:func:`scatter_heads_gather_sequence` with autograd (its backward is the inverse exchange)."""
    return all_to_all_differentiable(x, group, scatter_dim=_HEADS, gather_dim=_SEQUENCE)


def replicated_kv_heads(kv_heads: int, sp_size: int) -> int:
    """KV heads after :func:`replicate_kv_heads`: ``max(kv_heads, sp_size)``."""
    return max(kv_heads, sp_size)


def replicate_kv_heads(x: torch.Tensor, sp_size: int) -> torch.Tensor:
    """``(B, kv, s, D)`` -> ``(B, max(kv, sp), s, D)``: each KV head repeated ``sp / kv`` times when ``sp > kv``.

    Copies of one head are adjacent, so after the exchange rank ``r`` holds original head
    ``r // (sp / kv)``: the one its query heads attend with. Differentiable (autograd sums the copies).
    """
    kv_heads = x.shape[_HEADS]
    if sp_size <= kv_heads:
        return x
    return x.repeat_interleave(sp_size // kv_heads, dim=_HEADS)


def sum_replicated_kv_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, max(kv, sp), s, D)`` -> ``(B, kv, s, D)``: gradient of :func:`replicate_kv_heads` (copies summed)."""
    copies = grad.shape[_HEADS] // kv_heads
    if copies == 1:
        return grad
    return grad.unflatten(_HEADS, (kv_heads, copies)).sum(dim=_HEADS + 1)
