"""The memo executor's attention core across a sequence-parallel group (DeepSpeed-Ulysses exchanges)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from hf_memo.parallel.heads import HeadSplit
from hf_memo.parallel.ulysses import (
    gather_heads_scatter_sequence,
    repeat_kv_heads,
    scatter_heads_gather_sequence,
    sum_repeated_kv_heads,
)
from hf_memo.runtime.attention_core import AttentionStats, LocalAttention
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.executor import AttentionCore


class UlyssesAttention:
    """Causal attention over the group's whole sequence from this rank's ``(B, h, S / sp, D)`` shard.

    Forward exchanges q/k/v so each rank holds the whole sequence of its heads (its
    :class:`~hf_memo.parallel.heads.HeadSplit`'s: ``⌈h/sp⌉`` or ``⌊h/sp⌋`` query heads and the KV heads they use,
    repeated to one per query head where the split asks for it), runs the core and exchanges the output back; the
    statistics stay in the exchanged layout. Backward exchanges q/k/v (recomputed by the executor), the kept output
    and its gradient the same way, runs the core's backward and exchanges dq/dk/dv back (the gradients of a KV head
    that several ranks attended with summed). ``core`` attends over the whole exchanged rows:
    :class:`LocalAttention`, or a :class:`~hf_memo.runtime.varlen_attention.VarlenAttention` with the samples of
    the whole rows.

    Traits: a window and soft-cap apply as they are (each rank holds whole sequences); the inner core gets
    this rank's slice of the sinks, and the sinks' gradient comes back as a full ``(h,)`` tensor, zero outside
    this rank's heads: this rank's contribution, as every other parameter's gradient is one (the gradient
    reduction over the group's ranks combines their heads; see :mod:`hf_memo.parallel.causal_lm`).
    """

    def __init__(self, group: dist.ProcessGroup, size: int, core: AttentionCore | None = None) -> None:
        self.group, self.size = group, size
        self.core = LocalAttention() if core is None else core

    def _split(self, q: torch.Tensor, k: torch.Tensor) -> tuple[HeadSplit, int]:
        """The split of ``q``'s and ``k``'s heads over the group, and this rank's index in it."""
        return HeadSplit(q.shape[1], k.shape[1], self.size), dist.get_rank(self.group) if self.size > 1 else 0

    def _local(self, traits: AttentionTraits, heads: range) -> AttentionTraits:
        """``traits`` for this rank's query ``heads``: the sinks sliced to them."""
        if traits.sinks is None:
            return traits
        return replace(traits, sinks=traits.sinks[heads.start : heads.stop])

    def _exchange(
        self, split: HeadSplit, rank: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``(B, h | kv, S / sp, D)`` -> this rank's heads of the whole sequence, KV heads repeated where
        the split asks for it."""
        q = scatter_heads_gather_sequence(q, split.queries, self.group)
        k, v = (repeat_kv_heads(scatter_heads_gather_sequence(x, split.kvs, self.group), split, rank) for x in (k, v))
        return q, k, v

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits
    ) -> tuple[torch.Tensor, AttentionStats]:
        split, rank = self._split(q, k)
        local = self._local(traits, split.query(rank))
        out, stats = self.core.forward(*self._exchange(split, rank, q, k, v), local)
        return gather_heads_scatter_sequence(out, split.queries, split.heads, self.group), stats

    def backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        stats: AttentionStats,
        traits: AttentionTraits,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        split, rank = self._split(q, k)
        heads = split.query(rank)
        grad_out = scatter_heads_gather_sequence(grad_out, split.queries, self.group)
        dq, dk, dv, local_dsinks = self.core.backward(
            grad_out,
            *self._exchange(split, rank, q, k, v),
            scatter_heads_gather_sequence(out, split.queries, self.group),
            stats,
            self._local(traits, heads),
        )
        dsinks = None
        if local_dsinks is not None:
            dsinks = local_dsinks.new_zeros(split.heads)
            dsinks[heads.start : heads.stop] = local_dsinks
        dq = gather_heads_scatter_sequence(dq, split.queries, split.heads, self.group)
        dk, dv = (
            gather_heads_scatter_sequence(sum_repeated_kv_heads(g, split, rank), split.kvs, split.kv_heads, self.group)
            for g in (dk, dv)
        )
        return dq, dk, dv, dsinks
