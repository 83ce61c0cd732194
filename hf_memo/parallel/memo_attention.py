"""The memo executor's attention core across a sequence-parallel group (DeepSpeed-Ulysses exchanges)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_memo.parallel.ulysses import (
    gather_heads_scatter_sequence,
    replicate_kv_heads,
    scatter_heads_gather_sequence,
    sum_replicated_kv_heads,
)
from hf_memo.runtime.attention_core import AttentionStats, LocalAttention
from hf_memo.runtime.executor import AttentionCore


class UlyssesAttention:
    """Causal attention over the group's whole sequence from this rank's ``(B, h, S / sp, D)`` shard.

    Forward exchanges q/k/v so each rank holds ``h / sp`` heads of the whole sequence, runs the core
    and exchanges the output back; the statistics stay in the exchanged layout. Backward exchanges
    q/k/v (recomputed by the executor), the kept output and its gradient the same way, runs the
    core's backward and exchanges dq/dk/dv back (replicated KV heads' gradients summed).
    ``core`` attends over the whole exchanged rows: :class:`LocalAttention`, or a
    :class:`~hf_memo.runtime.varlen_attention.VarlenAttention` with the samples of the whole rows.
    """

    def __init__(self, group: dist.ProcessGroup, size: int, core: AttentionCore | None = None) -> None:
        self.group, self.size = group, size
        self.core = LocalAttention() if core is None else core

    def _scatter(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_heads_gather_sequence(x.contiguous(), self.group)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_heads_scatter_sequence(x.contiguous(), self.group)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float = 0.0
    ) -> tuple[torch.Tensor, AttentionStats]:
        k, v = replicate_kv_heads(k, self.size), replicate_kv_heads(v, self.size)
        out, stats = self.core.forward(self._scatter(q), self._scatter(k), self._scatter(v), scale, dropout_p)
        return self._gather(out), stats

    def backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        stats: AttentionStats,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv_heads = k.shape[1]
        k, v = replicate_kv_heads(k, self.size), replicate_kv_heads(v, self.size)
        dq, dk, dv = self.core.backward(
            self._scatter(grad_out),
            self._scatter(q),
            self._scatter(k),
            self._scatter(v),
            self._scatter(out),
            stats,
            scale,
        )
        return (
            self._gather(dq),
            sum_replicated_kv_heads(self._gather(dk), kv_heads),
            sum_replicated_kv_heads(self._gather(dv), kv_heads),
        )
