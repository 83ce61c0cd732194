"""Causal attention one block of queries at a time, exact against :mod:`.attention_core` on the whole sequence.

A block holds the ``s`` queries at positions ``[start, start + s)``; they attend to the key prefix
``[0, start + s)``. Kernels align a causal mask differently when ``S_q != S_k`` (PyTorch's CPU flash kernel from
the top left, flash-attn from the bottom right), so no call here relies on either: the prefix splits in two,

* the keys ``[0, start)``, which every query of the block sees: one call without a mask (``causal=False``);
* the keys ``[start, start + s)``, the block's own: one causal call on a square.

Forward: the two ``(out, lse)`` pairs merge exactly, ``lse = logaddexp(lse_1, lse_2)`` and
``out = out_1 exp(lse_1 - lse) + out_2 exp(lse_2 - lse)``, and the sinks are composed once with the result
(:mod:`.attention_sinks`). Backward: each part's kernel backward runs on the merged ``out`` and ``lse``: a
flash-style backward recomputes ``P = exp(t - lse)`` and ``rowsum(dO * O)`` from them, so each part's
``dq, dk, dv`` are exact partials of the block's; the ``dq`` parts sum, and the prefix's ``dk, dv`` are the two
parts' side by side. ``start == 0`` is the diagonal call alone.

Grouped-query attention on a kernel whose backward expands dK/dV to every query head (the CUDA flash kernels'
``dk_expanded``/``dv_expanded``, the memory-efficient kernel's expanded K/V, see
:mod:`~hf_memo.profiler.kernel_workspace`): the backward runs once per KV head, with that head's group of query
heads, so the expanded buffers hold one group's heads, not all of them. A fake profile recorded for a CUDA target
decides by the target's kernel, and so records the smaller workspace.

Dropout is not blocked (its mask is drawn over the whole sequence), nor a sliding window that hides a key
(:func:`blockable`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.minseq.grads import summing_dtype
from hf_memo.profiler.kernel_workspace import PROFILED_TARGET, AttentionCall, needs_kv_expansion
from hf_memo.profiler.placement import mark_part
from hf_memo.runtime.attention_core import (
    AttentionStats,
    attention_backward,
    attention_forward,
    backend_for,
    compute_dtype,
    kernel_window,
)
from hf_memo.runtime.attention_sinks import apply_sinks_, sinks_grad
from hf_memo.runtime.attention_traits import AttentionTraits

_EXPANDING_FLASH = ("flash-attn", "cuda-flash")  # flash kernels whose backward expands dK/dV for h_kv < h
_EFFICIENT_LSE_ROWS = 32  # the memory-efficient kernel's lse holds the queries padded to this multiple


def blockable(length: int, traits: AttentionTraits) -> bool:
    """Whether causal attention over ``length`` positions with ``traits`` may run block by block: no dropout, and no
    sliding window that hides one of the keys. Soft-capping and sinks are fine."""
    return kernel_window(traits, length) is None and traits.dropout_p == 0


def _kernel_traits(traits: AttentionTraits, length: int) -> AttentionTraits:
    """``traits`` for both parts' kernel calls on a prefix of ``length`` keys: no sinks (composed after the merge)
    and no window (it hides none of them: :func:`blockable`).

    Raises:
        ValueError: dropout, or a window that hides one of the ``length`` keys.
    """
    if traits.dropout_p > 0 or kernel_window(traits, length) is not None:
        raise ValueError("blocked attention takes no dropout and no sliding window that hides a key (see blockable)")
    return replace(traits, window=None, sinks=None)


def _parts(start: int, length: int, piece: int | None = None) -> list[tuple[slice, bool]]:
    """The prefix's key parts and whether each is causal: the block's own keys, then ``[0, start)`` if any, cut
    into pieces of at most ``piece`` keys if given."""
    own = [(slice(start, length), True)]
    if start == 0:
        return own
    if piece is None:
        return own + [(slice(0, start), False)]
    return own + [(slice(a, b), False) for a, b in chunk_bounds(start, -(-start // piece))]


@torch.no_grad()
def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, traits: AttentionTraits
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one block of queries over its key prefix, building no graph.

    Args:
        q: ``(B, h, s, D)`` queries at positions ``[start, start + s)`` (e.g. a view of ``(B, S, h, D)`` memory).
        k, v: ``(B, h_kv, start + s, D)`` the key prefix, ``h % h_kv == 0``; all with a unit last stride. Under
            autocast all three are cast to the autocast dtype first, as in
            :func:`~hf_memo.runtime.attention_core.attention_forward`.
        start: the block's first position.
        traits: the layer's attention traits (:func:`blockable`).

    Returns:
        ``out`` ``(B, h, s, D)`` laid out as the kernel lays out ``q``, and ``lse`` ``(B, h, s)`` in the kernel's
        dtype (fp32, or fp64 for fp64 inputs on the CPU), the sinks included.
    """
    dtype = compute_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kernel_traits = _kernel_traits(traits, k.shape[2])
    rows = q.shape[2]
    out, stats = attention_forward(q, k[:, :, start:], v[:, :, start:], kernel_traits)
    lse = stats.lse[..., :rows]  # the memory-efficient kernel pads it
    if start > 0:
        mark_part("attention forward over a prefix")
        prefix_out, prefix_stats = attention_forward(q, k[:, :, :start], v[:, :, :start], kernel_traits, causal=False)
        prefix_lse = prefix_stats.lse[..., :rows]
        total = torch.logaddexp(lse, prefix_lse)
        out.copy_(out * torch.exp(lse - total)[..., None] + prefix_out * torch.exp(prefix_lse - total)[..., None])
        lse = total
    if traits.sinks is not None:
        apply_sinks_(out, lse, traits.sinks)
    return out, lse


def _expands_kv_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> bool:
    """Whether ``backend``'s backward on ``q`` ``(B, h, s, D)``, ``k, v`` ``(B, h_kv, S_k, D)`` holds dK/dV (or K/V)
    expanded to all ``h`` query heads; in a fake profile for a CUDA target, the backward of the target's kernel."""
    if k.shape[1] == q.shape[1]:
        return False
    target = PROFILED_TARGET.get()
    if backend == "cpu-flash" and target is not None and target.device == "cuda" and is_fake(q):
        backend = target.kernel_for(AttentionCall.of(q, k, v))  # the CPU op stands in for it (backend_for)
    return backend in _EXPANDING_FLASH or needs_kv_expansion(backend)


def _stats(backend: str, lse: torch.Tensor, kv_len: int) -> AttentionStats:
    """What ``backend``'s dropout-free forward of ``lse.shape[2]`` queries against ``kv_len`` keys would have
    returned for its backward, with ``lse`` ``(B, h', s)`` (the block's merged one) in the layout the kernel reads."""
    if backend == "cuda-efficient":
        batch, heads, rows = lse.shape
        padded = lse.new_zeros(batch, heads, -(-rows // _EFFICIENT_LSE_ROWS) * _EFFICIENT_LSE_ROWS)
        padded[..., :rows] = lse
        return AttentionStats(padded, (_no_rng(), _no_rng()))
    lse = lse.contiguous()
    if backend == "cuda-flash":
        return AttentionStats(lse, (None, None, lse.shape[2], kv_len, _no_rng(), _no_rng()))
    if backend == "flash-attn":
        return AttentionStats(lse, (None,))
    if backend == "explicit":
        return AttentionStats(lse, (0,))
    return AttentionStats(lse)


def _no_rng() -> torch.Tensor:
    """The RNG seed or offset the CUDA kernels return without dropout: an empty int64 scalar."""
    return torch.empty((), dtype=torch.long)


_POSITIONS_FIRST = (2, 0, 1, 3)  # sums in (S, B, h_kv, D) memory: a range of positions of all KV heads is dense
_HEADS_FIRST = (1, 2, 0, 3)  # sums in (h_kv, S, B, D) memory: a range of positions of one KV head is dense


def _logical(order: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation taking dims laid out in ``order`` back to ``(B, h_kv, S, D)``."""
    return tuple(order.index(dim) for dim in range(len(order)))


def _laid_out(grad: torch.Tensor, dtype: torch.dtype, order: tuple[int, ...]) -> torch.Tensor:
    """``grad`` ``(B, h', s, D)`` as a contiguous tensor of ``dtype`` with its dims in ``order`` (``(s, B, h', D)``
    or ``(h', s, B, D)``): ``grad`` itself, permuted, where it already is one, else one copy (and cast)."""
    physical = grad.permute(order)
    if grad.dtype == dtype and physical.is_contiguous():
        return physical
    return torch.empty(physical.shape, dtype=dtype, device=grad.device).copy_(physical)


class KeyGradSums:
    """Running sums of the keys' and values' gradients over query blocks, ``(B, h_kv, S, D)`` each, kept as pieces
    of positions: float32 for half inputs (one rounding per kernel call, none per block), else the keys' dtype.

    A piece whose keys have every gradient (no later block attends to them) is taken out with :meth:`pop`, and its
    memory goes back when the caller drops it: causal blocks run last block first, so a piece is final as soon as
    its own block is done.

    Each kernel call's ``dk, dv`` go to the pieces they overlap in one foreach add that takes CUDA's fast path (one
    kernel for many tensors, not one per piece): every tensor of it dense, of the sums' dtype, each gradient's part
    with its sums' sizes and strides. So ``dk, dv`` are first cast to the sums' dtype in a layout whose ranges of
    positions are dense, and the sums are kept in the same layout: positions first, ``(S, B, h_kv, D)`` memory,
    for calls over all KV heads; KV heads first, ``(h_kv, S, B, D)``, for the per-KV-head calls of the kernels that
    expand dK/dV (:func:`block_backward`), whose part of a piece is then one head's range of positions, dense too.
    The first call decides (the sums are all zeros until then, so their memory takes either layout); a later call
    of the other kind is still exact, its add just not on the fast path.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, bounds: list[tuple[int, int]] | None = None) -> None:
        """Zeroed sums for ``k`` and ``v`` ``(B, h_kv, S, D)``, one pair per piece ``[start, stop)`` of ``bounds``
        (default: one piece, the whole sequence)."""
        self.dtype = summing_dtype(k.dtype)
        self._kv_heads = k.shape[1]
        self._dims = tuple((t.shape[0], t.shape[1], t.shape[3]) for t in (k, v))  # (B, h_kv, D) of dk, dv
        self._memory: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {
            (start, stop): tuple(
                torch.zeros(batch * heads * (stop - start) * dim, dtype=self.dtype, device=k.device)
                for batch, heads, dim in self._dims
            )
            for start, stop in sorted(bounds or [(0, k.shape[2])])
        }
        self._order: tuple[int, ...] | None = None  # the layout, once the first call chose it
        # each piece's targets for one group of KV heads, made once: a prefix overlaps as many pieces as there are
        # blocks below it, and slicing them anew for each kernel call made a layer's backward quadratic in its blocks
        self._targets: dict[tuple[int, int], dict[tuple[int | None, int | None], tuple[list[torch.Tensor], ...]]] = {}

    def _laid_out_piece(self, piece: tuple[int, int], index: int) -> torch.Tensor:
        """Piece ``piece``'s sums of dk (``index`` 0) or dv (1) in their memory's layout (``(S_piece, B, h_kv, D)``
        or ``(h_kv, S_piece, B, D)``)."""
        batch, heads, dim = self._dims[index]
        logical = (batch, heads, piece[1] - piece[0], dim)
        return self._memory[piece][index].view([logical[d] for d in self._order])

    def _piece_targets(self, piece: tuple[int, int], heads: slice) -> tuple[list[torch.Tensor], ...]:
        """Piece ``piece``'s sums of KV heads ``heads`` as tensors whose first dim is the piece's positions, for dk
        and for dv: one per KV head (``(S_piece, B, D)``, heads first) or one for all (``(S_piece, B, h', D)``)."""
        by_heads = self._targets.setdefault(piece, {})
        if (heads.start, heads.stop) not in by_heads:
            laid_out = (self._laid_out_piece(piece, index) for index in range(2))
            if self._order == _HEADS_FIRST:
                by_heads[heads.start, heads.stop] = tuple(list(sums[heads]) for sums in laid_out)
            else:
                by_heads[heads.start, heads.stop] = tuple([sums[:, :, heads]] for sums in laid_out)
        return by_heads[heads.start, heads.stop]

    def _overlaps(self, keys: slice) -> list[tuple[tuple[int, int], int, int]]:
        """Each piece ``keys`` overlap, with the positions ``[first, last)`` they share, in order of positions.

        Raises:
            ValueError: some of ``keys`` are in no piece (a popped one).
        """
        overlaps = []
        for start, stop in self._memory:
            first, last = max(start, keys.start), min(stop, keys.stop)
            if first < last:
                overlaps.append(((start, stop), first, last))
        if sum(last - first for _, first, last in overlaps) != keys.stop - keys.start:
            raise ValueError(f"keys {keys.start}:{keys.stop} reach past the pieces still summed ({list(self._memory)})")
        return overlaps

    @torch.no_grad()
    def add(self, heads: slice, keys: slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add one kernel call's ``dk, dv`` ``(B, h', keys.stop - keys.start, D)``, the gradients of keys ``keys`` of
        KV heads ``heads``, to every piece they overlap (pieces tile the keys), in one foreach add."""
        overlaps = self._overlaps(keys)
        sizes = [last - first for _, first, last in overlaps]
        if self._order is None:
            self._order = _HEADS_FIRST if len(range(self._kv_heads)[heads]) < self._kv_heads else _POSITIONS_FIRST
        targets = [self._piece_targets(piece, heads) for piece, _, _ in overlaps]
        totals, parts = [], []
        for index, grad in enumerate((dk, dv)):
            grad = _laid_out(grad, self.dtype, self._order)
            sources = grad.unbind(0) if self._order == _HEADS_FIRST else (grad,)  # positions first, as the targets
            for head, source in enumerate(sources):
                for (piece, first, last), piece_targets, part in zip(overlaps, targets, source.split(sizes)):
                    target = piece_targets[index][head]
                    totals.append(target if len(target) == last - first else target[first - piece[0] : last - piece[0]])
                    parts.append(part)
        torch._foreach_add_(totals, parts)

    def pop(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sums ``(dk, dv)`` ``(B, h_kv, stop - start, D)`` of piece ``[start, stop)``, no longer held here
        (views of memory laid out as :class:`KeyGradSums` says)."""
        self._order = self._order or _POSITIONS_FIRST
        self._targets.pop((start, stop), None)
        sums = tuple(self._laid_out_piece((start, stop), index).permute(_logical(self._order)) for index in range(2))
        del self._memory[start, stop]
        return sums


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    start: int,
    traits: AttentionTraits,
    key_sums: KeyGradSums,
    prefix_piece: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`block_forward` from its ``out`` and ``lse``: ``(dq, dsinks)``, and the block's part of the
    prefix keys' gradients added to ``key_sums``.

    Args:
        grad_out: ``(B, h, s, D)`` the gradient of ``out``.
        q, k, v, start, traits: as given to :func:`block_forward`.
        out, lse: ``(B, h, s, D)`` and ``(B, h, s)`` as :func:`block_forward` returned them.
        key_sums: running sums of the keys' and values' gradients over blocks, covering at least the prefix's
            ``start + s`` positions: the kernels' gradients are added to them as each call returns them, so no
            gradient of the whole prefix is allocated.
        prefix_piece: on a kernel whose backward expands dK/dV (or K/V) to the query heads, the keys before the block
            go to it in pieces of at most this many (each an exact partial, as the two parts are), so what it
            expands is one piece's keys, not the whole prefix's.

    Returns:
        ``dq`` ``(B, h, s, D)`` in ``q``'s dtype; ``dsinks`` ``(h,)`` the block's part of the sinks' gradient
        (``None`` without sinks).
    """
    q_dtype = q.dtype
    q, k, v, grad_out = (t.to(out.dtype) for t in (q, k, v, grad_out))
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    kernel_traits = _kernel_traits(traits, k.shape[2])
    backend = backend_for(q, kernel_traits, value_head_dim=v.shape[-1])
    dq = torch.empty_like(q, dtype=q_dtype)
    groups = q.shape[1] // k.shape[1]
    expands = _expands_kv_grads(q, k, v, backend)
    if expands:  # one KV head and its group of query heads per call
        head_groups = [(slice(j * groups, (j + 1) * groups), slice(j, j + 1)) for j in range(k.shape[1])]
    else:
        head_groups = [(slice(None), slice(None))]
    parts = _parts(start, k.shape[2], prefix_piece if expands else None)
    for qh, kv in head_groups:
        for index, (keys, causal) in enumerate(parts):
            mark_part("attention backward over the block's own keys" if causal else "attention backward over a prefix")
            _part_backward_into(
                dq[:, qh],
                lambda dk, dv, kv=kv, keys=keys: key_sums.add(kv, keys, dk, dv),
                index > 0,
                (grad_out[:, qh], q[:, qh], k[:, kv, keys], v[:, kv, keys], out[:, qh]),
                _stats(backend, lse[:, qh], keys.stop - keys.start),
                kernel_traits,
                causal,
            )
    if traits.sinks is None:
        return dq, None
    return dq, sinks_grad(grad_out, out, lse, traits.sinks)


def _part_backward_into(
    dq: torch.Tensor,
    add_key_grads: Callable[[torch.Tensor, torch.Tensor], None],
    accumulate_dq: bool,
    tensors: tuple[torch.Tensor, ...],
    stats: AttentionStats,
    traits: AttentionTraits,
    causal: bool,
) -> None:
    """One kernel backward on ``tensors`` ``(grad_out, q, k, v, out)``: its dq written into ``dq`` (added to when
    ``accumulate_dq``), its dk and dv handed to ``add_key_grads``; the kernel's own gradients die on return."""
    part_dq, part_dk, part_dv, _ = attention_backward(*tensors, stats, traits, causal)
    if accumulate_dq:
        dq += part_dq
    else:
        dq.copy_(part_dq)
    del part_dq
    add_key_grads(part_dk, part_dv)


QUERY_BLOCKS = 8  # blocks a whole sequence's queries are cut into by QueryBlockAttention


class QueryBlockAttention:
    """The attention core on a whole sequence (the protocol of
    :class:`~hf_memo.runtime.attention_core.LocalAttention`), computed ``blocks`` blocks of queries at a time where
    :func:`blockable`: the kernels' workspace is one block's, and dK/dV are summed over the blocks in fp32 for half
    inputs. Elsewhere (dropout, a window hiding keys) the whole sequence in one call, as ``LocalAttention``.

    The memo executor runs its own blocks, one per chunk, for a local core; this core serves where attention runs
    on other rows than the executor's chunks: after a sequence-parallel exchange (each rank's heads of the whole
    sequence). A kernel that expands dK/dV gets each block's prefix in pieces of the block's length: a rank of ``P``
    holds all ``S`` keys of its heads, and one call over them would expand ``P`` times more than the local core's.
    """

    def __init__(self, blocks: int = QUERY_BLOCKS) -> None:
        self.blocks = blocks

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits
    ) -> tuple[torch.Tensor, AttentionStats]:
        """Output ``(B, h, S, D)`` (a view of ``(B, S, h, D)`` memory) and its statistics, from ``q`` ``(B, h, S, D)``
        and ``k, v`` ``(B, h_kv, S, D)``."""
        if not blockable(q.shape[2], traits):
            return attention_forward(q, k, v, traits)
        batch, heads, length, _ = q.shape
        out = lse = None
        for start, stop in chunk_bounds(length, self.blocks):
            rows, rows_lse = block_forward(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], start, traits)
            if out is None:
                out = rows.new_empty(batch, length, heads, v.shape[-1]).transpose(1, 2)
                lse = rows_lse.new_empty(batch, heads, length)
            out[:, :, start:stop], lse[:, :, start:stop] = rows, rows_lse
        return out, AttentionStats(lse)

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
        """``(dq, dk, dv, dsinks)`` as :func:`~hf_memo.runtime.attention_core.attention_backward` gives them."""
        if not blockable(q.shape[2], traits):
            return attention_backward(grad_out, q, k, v, out, stats, traits)
        key_sums = KeyGradSums(k, v)
        dq = torch.empty_like(q)
        dsinks = None
        for start, stop in reversed(chunk_bounds(q.shape[2], self.blocks)):
            rows = slice(start, stop)
            dq[:, :, rows], block_dsinks = block_backward(
                grad_out[:, :, rows], q[:, :, rows], k[:, :, :stop], v[:, :, :stop], out[:, :, rows],
                stats.lse[:, :, rows], start, traits, key_sums, prefix_piece=stop - start,
            )  # fmt: skip
            if block_dsinks is not None:
                dsinks = block_dsinks if dsinks is None else dsinks + block_dsinks
        dk, dv = key_sums.pop(0, q.shape[2])
        return dq, dk.to(k.dtype), dv.to(v.dtype), dsinks
