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
from hf_memo.runtime.attention_core import AttentionStats, LocalAttention, kernel_window
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.blocked_attention import KeyGradSums, QueryBlockAttention, block_backward, block_forward
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

    def _split(self, heads: int, kv_heads: int) -> tuple[HeadSplit, int]:
        """The split of ``heads`` query and ``kv_heads`` KV heads over the group, and this rank's index in it."""
        return HeadSplit(heads, kv_heads, self.size), dist.get_rank(self.group) if self.size > 1 else 0

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

    def _returned(self, split: HeadSplit, rank: int, grad: torch.Tensor, kv: bool) -> torch.Tensor:
        """The inverse trip of :meth:`_gathered` for a result: ``(B, h_r | kv_r, S, D)`` of this rank's heads (KV heads
        repeated where the split asks for it) -> ``(B, h | h_kv, S / sp, D)``, what several ranks return for one KV
        head summed."""
        if not kv:
            return gather_heads_scatter_sequence(grad, split.queries, split.heads, self.group)
        summed = sum_repeated_kv_heads(grad, split, rank)
        return gather_heads_scatter_sequence(summed, split.kvs, split.kv_heads, self.group)

    @staticmethod
    def _sinks_grad(split: HeadSplit, heads: range, local: torch.Tensor | None) -> torch.Tensor | None:
        """The sinks' gradient ``(h,)`` from this rank's ``local`` part ``(len(heads),)``: zero outside its heads."""
        if local is None:
            return None
        grad = local.new_zeros(split.heads)
        grad[heads.start : heads.stop] = local
        return grad

    def blocks_queries(self, length: int, traits: AttentionTraits) -> bool:
        """Whether a layer's backward on this rank's ``length`` positions may run its attention one chunk of queries
        at a time (:meth:`query_blocks`): the inner core attends in query blocks and ``traits`` allow blocks over
        the group's whole sequence (no dropout, no window hiding a key)."""
        whole = length * self.size
        blockable = traits.dropout_p == 0 and kernel_window(traits, whole) is None
        return isinstance(self.core, QueryBlockAttention) and blockable

    def query_blocks(
        self, heads: int, keys: list[torch.Tensor | None], lse: torch.Tensor | None, traits: AttentionTraits
    ) -> ExchangedQueryBlocks:
        """The attention of a layer with ``heads`` query heads for its backward chunk by chunk
        (:class:`ExchangedQueryBlocks`), from this rank's ``keys`` ``[k, v]`` (each entry set to ``None`` once
        exchanged) and, for a layer that kept its attention, the statistics its forward returned (``lse``
        ``(B, h_r, S)``, in the exchanged layout)."""
        return ExchangedQueryBlocks(self, heads, keys, lse, traits)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits
    ) -> tuple[torch.Tensor, AttentionStats]:
        split, rank = self._split(q.shape[1], k.shape[1])
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
        split, rank = self._split(tensors[1].shape[1], tensors[2].shape[1])
        heads = split.query(rank)
        exchanged = []
        for index, kv in enumerate((False, False, True, True, False)):  # grad_out, q, k, v, out
            exchanged.append(self._gathered(split, rank, tensors[index], kv))
            tensors[index] = None
        dq, dk, dv, local_dsinks = self.core.backward(*exchanged, stats, self._local(traits, heads))
        del exchanged
        dq = self._returned(split, rank, dq, kv=False)
        dk, dv = (self._returned(split, rank, g, kv=True) for g in (dk, dv))
        return dq, dk, dv, self._sinks_grad(split, heads, local_dsinks)


class ExchangedQueryBlocks:
    """One layer's attention across the group, for a backward that runs chunk by chunk of the rank's positions.

    The keys and values are exchanged once and held, with their gradients' sums (fp32 for half inputs), for the
    whole backward; each chunk ``[start, stop)`` of the rank's ``s`` positions exchanges only its own rows of q, the
    output and its gradient. A chunk's rows of every rank arrive side by side: rank ``r``'s are the group's
    positions ``[r s + start, r s + stop)``, one block of queries each (:func:`block_forward`, :func:`block_backward`)
    over the key prefix up to it, and the block's dq goes back to its rank at once. dK and dV are final only after
    the last chunk (queries of later ranks see every key), so :meth:`key_grads` comes after all of them. What the
    rank holds beyond one chunk: k, v of its heads of the whole sequence and their gradients' sums (the bytes of
    the rank's k, v, twice for the sums in fp32).

    Shapes: ``q`` and ``out`` rows are ``(B, h, stop - start, D)`` at the rank's positions, all heads.
    """

    def __init__(
        self,
        attention: UlyssesAttention,
        heads: int,
        keys: list[torch.Tensor | None],
        lse: torch.Tensor | None,
        traits: AttentionTraits,
    ) -> None:
        self.attention = attention
        self.split, self.rank = attention._split(heads, keys[0].shape[1])
        self.heads = self.split.query(self.rank)
        self.traits = attention._local(traits, self.heads)
        exchanged = []
        for index in range(2):
            exchanged.append(attention._gathered(self.split, self.rank, keys[index], kv=True))
            keys[index] = None
        self.k, self.v = exchanged
        self.dtypes = (self.k.dtype, self.v.dtype)
        self.key_sums = KeyGradSums(self.k, self.v)
        self.positions = self.k.shape[2] // attention.size
        self.lse = lse
        self.dsinks: torch.Tensor | None = None

    def _pieces(self, start: int, stop: int) -> list[tuple[slice, int, int]]:
        """Each rank's rows of chunk ``[start, stop)`` after the exchange: ``(rows, first, last)``, its place among
        the received rows and its positions ``[first, last)`` in the group's sequence."""
        s, rows = self.positions, stop - start
        return [(slice(r * rows, (r + 1) * rows), r * s + start, r * s + stop) for r in range(self.attention.size)]

    def _exchange(self, rows: torch.Tensor) -> torch.Tensor:
        return self.attention._gathered(self.split, self.rank, rows, kv=False)

    def _return(self, rows: torch.Tensor) -> torch.Tensor:
        return self.attention._returned(self.split, self.rank, rows, kv=False)

    def forward(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The attention output of the chunk's queries ``q`` (recomputed: the layer kept its input only); its
        statistics are kept for :meth:`backward`."""
        q = self._exchange(q)
        batch, heads, rows, _ = q.shape
        out = None
        for place, first, last in self._pieces(start, stop):
            rows_out, lse = block_forward(q[:, :, place], self.k[:, :, :last], self.v[:, :, :last], first, self.traits)
            if out is None:
                out = rows_out.new_empty(batch, rows, heads, rows_out.shape[-1]).transpose(1, 2)
            if self.lse is None:
                self.lse = lse.new_empty(batch, heads, self.k.shape[2])
            out[:, :, place], self.lse[:, :, first:last] = rows_out, lse
        del q
        return self._return(out)

    def backward(
        self, grad_out: torch.Tensor, q: torch.Tensor, out: torch.Tensor, start: int, stop: int
    ) -> torch.Tensor:
        """dq of the chunk's rows from their output's gradient ``grad_out``, ``q`` and the output; the keys' and
        values' gradients are added to the sums."""
        grad_out, q, out = (self._exchange(t) for t in (grad_out, q, out))
        dq = torch.empty_like(q)
        for place, first, last in self._pieces(start, stop):
            dq[:, :, place], dsinks = block_backward(
                grad_out[:, :, place], q[:, :, place], self.k[:, :, :last], self.v[:, :, :last], out[:, :, place],
                self.lse[:, :, first:last], first, self.traits, self.key_sums, prefix_piece=self.positions,
            )  # fmt: skip
            if dsinks is not None:
                self.dsinks = dsinks if self.dsinks is None else self.dsinks + dsinks
        del grad_out, q, out
        return self._return(dq)

    def key_grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(dk, dv, dsinks)`` once every chunk is done: dk, dv ``(B, h_kv, s, D)`` at the rank's positions (what
        several ranks return for one KV head summed), ``dsinks`` ``(h,)`` zero outside this rank's heads."""
        length = self.k.shape[2]
        self.k = self.v = self.lse = None
        sums = list(self.key_sums.pop(0, length))
        grads = []
        for index, dtype in enumerate(self.dtypes):
            narrowed = sums[index].to(dtype)
            sums[index] = None  # the fp32 sums go before the exchange's buffers come
            grads.append(self.attention._returned(self.split, self.rank, narrowed, kv=True))
            del narrowed
        return grads[0], grads[1], UlyssesAttention._sinks_grad(self.split, self.heads, self.dsinks)
