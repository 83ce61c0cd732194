"""The memo executor's attention core across a sequence-parallel group (DeepSpeed-Ulysses exchanges)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from hf_memo.parallel.ulysses import (
    gather_heads_scatter_sequence,
    replicate_kv_heads,
    scatter_heads_gather_sequence,
    sum_replicated_kv_heads,
)
from hf_memo.runtime.attention_core import AttentionStats, LocalAttention
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.executor import AttentionCore


class UlyssesAttention:
    """Causal attention over the group's whole sequence from this rank's ``(B, h, S / sp, D)`` shard.

    Forward exchanges q/k/v so each rank holds ``h / sp`` heads of the whole sequence, runs the core
    and exchanges the output back; the statistics stay in the exchanged layout. Backward exchanges
    q/k/v (recomputed by the executor), the kept output and its gradient the same way, runs the
    core's backward and exchanges dq/dk/dv back (replicated KV heads' gradients summed).
    ``core`` attends over the whole exchanged rows: :class:`LocalAttention`, or a
    :class:`~hf_memo.runtime.varlen_attention.VarlenAttention` with the samples of the whole rows.

    Traits: a window and soft-cap apply as they are (each rank holds whole sequences); the inner core gets
    this rank's slice of the sinks, and the sinks' gradient comes back as a full ``(h,)`` tensor, zero outside
    this rank's heads: this rank's contribution, as every other parameter's gradient is one (the gradient
    reduction over the group's ranks combines their heads; see :mod:`hf_memo.parallel.causal_lm`).
    """

    def __init__(self, group: dist.ProcessGroup, size: int, core: AttentionCore | None = None) -> None:
        self.group, self.size = group, size
        self.core = LocalAttention() if core is None else core

    def _scatter(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_heads_gather_sequence(x.contiguous(), self.group)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_heads_scatter_sequence(x.contiguous(), self.group)

    def _heads(self, heads: int) -> slice:
        """This rank's query heads after the exchange, of ``heads``."""
        rank = dist.get_rank(self.group) if self.size > 1 else 0
        step = heads // self.size
        return slice(rank * step, (rank + 1) * step)

    def _local(self, traits: AttentionTraits, heads: int) -> AttentionTraits:
        """``traits`` for this rank's heads: the sinks sliced to them."""
        if traits.sinks is None:
            return traits
        return replace(traits, sinks=traits.sinks[self._heads(heads)])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits
    ) -> tuple[torch.Tensor, AttentionStats]:
        k, v = replicate_kv_heads(k, self.size), replicate_kv_heads(v, self.size)
        local = self._local(traits, q.shape[1])
        out, stats = self.core.forward(self._scatter(q), self._scatter(k), self._scatter(v), local)
        return self._gather(out), stats

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
        kv_heads = k.shape[1]
        k, v = replicate_kv_heads(k, self.size), replicate_kv_heads(v, self.size)
        dq, dk, dv, local_dsinks = self.core.backward(
            self._scatter(grad_out),
            self._scatter(q),
            self._scatter(k),
            self._scatter(v),
            self._scatter(out),
            stats,
            self._local(traits, q.shape[1]),
        )
        dsinks = None
        if local_dsinks is not None:
            dsinks = local_dsinks.new_zeros(q.shape[1])
            dsinks[self._heads(q.shape[1])] = local_dsinks
        return (
            self._gather(dq),
            sum_replicated_kv_heads(self._gather(dk), kv_heads),
            sum_replicated_kv_heads(self._gather(dv), kv_heads),
            dsinks,
        )
