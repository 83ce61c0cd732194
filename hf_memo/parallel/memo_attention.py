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

    def _gathered(self, split: HeadSplit, rank: int, shard: torch.Tensor, kv: bool) -> torch.Tensor:
        """A shard ``(B, h | kv, S / sp, D)`` of q, out or their gradient (``kv``: of k or v) -> this rank's heads of
        the whole sequence, KV heads repeated where the split asks for it."""
        if not kv:
            return scatter_heads_gather_sequence(shard, split.queries, self.group)
        return repeat_kv_heads(scatter_heads_gather_sequence(shard, split.kvs, self.group), split, rank)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits
    ) -> tuple[torch.Tensor, AttentionStats]:
        split, rank = self._split(q, k)
        local = self._local(traits, split.query(rank))
        q, k, v = (self._gathered(split, rank, t, kv) for t, kv in ((q, False), (k, True), (v, True)))
        out, stats = self.core.forward(q, k, v, local)
        del q, k, v
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
        return self.backward_releasing([grad_out, q, k, v, out], stats, traits)

    def backward_releasing(
        self, tensors: list[torch.Tensor | None], stats: AttentionStats, traits: AttentionTraits
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`backward` of ``tensors`` ``[grad_out, q, k, v, out]`` (this rank's shards), each entry set to
        ``None`` once it is exchanged: a shard the caller no longer holds is freed before the inner core's backward,
        so the rank holds one layout of them, not two, while it runs."""
        split, rank = self._split(tensors[1], tensors[2])
        heads = split.query(rank)
        exchanged = []
        for index, kv in enumerate((False, False, True, True, False)):  # grad_out, q, k, v, out
            exchanged.append(self._gathered(split, rank, tensors[index], kv))
            tensors[index] = None
        dq, dk, dv, local_dsinks = self.core.backward(*exchanged, stats, self._local(traits, heads))
        del exchanged
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
