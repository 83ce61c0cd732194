"""The memo executor's attention core for rows holding several samples or padding (see :mod:`.batch_layout`).

It runs :func:`~hf_memo.runtime.attention_core.attention_forward` / ``attention_backward`` once per
block of :meth:`~hf_memo.runtime.batch_layout.BatchLayout.blocks`: per sample on its ``[start, stop)``
slice of the row (a token attends causally within its own sample), and where the labels train the
padding after a sample, once more for those padding queries over all of the sample's keys (not
causal), as transformers' masks give them. Other padding tokens get a zero output and a zero gradient,
and the work is ``Σ sᵢ²`` (plus the padding blocks), not ``S²``.

Attention traits (:class:`~hf_memo.runtime.attention_traits.AttentionTraits`) apply per sample: a sliding
window is relative to the query, so it applies within each sample's block (a window no sample's reach
exceeds is none); sinks join every query's softmax and their gradient sums over the blocks. The padding
queries of ``padding_attends`` attend to their sample's keys without causal positions, so a window shorter
than :meth:`~hf_memo.runtime.batch_layout.BatchLayout.reach` is refused where padding attends.

On CUDA, where the flash kernel serves the step (fp16/bf16, see
:func:`~hf_memo.runtime.attention_core.backend_for`), no padding attends and the layer does not soft-cap
its scores (PyTorch's varlen kernel takes a window but no soft-cap), the samples' tokens are
gathered into one packed ``(total, h, D)`` tensor and attended in one call of PyTorch's varlen flash
kernel (``cu_seqlens``: every sample's start in the packed tensor): a row of 256 short samples is one
kernel call, not 256 (:class:`PackedKernels`); sinks are composed with its result (:mod:`.attention_sinks`).
Elsewhere, per-sample calls rather than one block-causal
masked call: the CPU kernels take no ``cu_seqlens``, and a block-diagonal mask makes them compute (and the
mask hold) all ``S²`` pairs.
Measured on CPU (fp32, one thread, 8 heads of 64, a 4096-token row, forward + backward, torch 2.13):
9 samples of 64 to 1024 tokens: per-sample calls 0.69 s, one call with a block-causal mask 4.20 s;
256 samples of 16 tokens: 0.20 s vs 4.34 s (the loop's overhead stays far below the saved pairs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from hf_memo.runtime.attention_core import (
    AttentionStats,
    LocalAttention,
    attention_backward,
    attention_forward,
    backend_for,
    compute_dtype,
    flash_window,
)
from hf_memo.runtime.attention_sinks import apply_sinks_, sinks_grad
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.batch_layout import BatchLayout

_ops = torch.ops.aten


class PackedKernels:
    """Causal attention over the samples of one packed ``(total, h, D)`` tensor in one call: PyTorch's CUDA flash
    kernel with ``cu_seqlens`` (int32 ``(samples + 1,)``, each sample's start, then ``total``), the window (if any)
    within each sample. The statistics are the kernel's: lse ``(h, total)`` and the RNG state that replays the
    dropout mask."""

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu: torch.Tensor,
        longest: int,
        scale: float,
        p: float,
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        out, lse, rng_state, unused, _ = _ops._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, p, True, False, scale=scale, **flash_window(window)
        )
        return out, lse, (rng_state, unused)

    @staticmethod
    def backward(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        extra: tuple,
        cu: torch.Tensor,
        longest: int,
        scale: float,
        p: float,
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rng_state, unused = extra
        return _ops._flash_attention_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            cu,
            cu,
            longest,
            longest,
            p,
            True,
            rng_state,
            unused,
            scale=scale,
            **flash_window(window),
        )


def packed_kernels_for(
    q: torch.Tensor, v: torch.Tensor, layout: BatchLayout, traits: AttentionTraits
) -> type[PackedKernels] | None:
    """:class:`PackedKernels` where they serve ``q`` ``(B, h, S, D)`` and ``v`` with ``traits`` (CUDA, the flash
    kernel's dtypes and head sizes, no soft-cap) and every block of ``layout`` is a causal sample (no padding attends),
    else ``None``."""
    if layout.padding_attends or traits.softcap is not None:
        return None
    flash = backend_for(q.to(compute_dtype(q)), traits, value_head_dim=v.shape[-1]) in ("cuda-flash", "flash-attn")
    return PackedKernels if flash else None


class VarlenAttention:
    """Attention over the blocks of a :class:`BatchLayout` (:meth:`~BatchLayout.blocks`), on ``(B, h, S, D)`` tensors.

    The output is a view of ``(B, S, h, D)`` memory, as the executor keeps it (its rows are views).
    The statistics hold every block's softmax statistics flattened into one tensor (so the executor
    stashes a single one); ``extra`` keeps each block's shape and backend extras to split it again.
    """

    def __init__(self, layout: BatchLayout, packed: type[PackedKernels] | None = None) -> None:
        """``packed``: kernels to use whatever the device (tests stand CPU kernels in); by default
        :func:`packed_kernels_for` decides per call."""
        self.layout = layout
        self.packed = packed
        self._indices: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, int]] = {}

    def _traits(self, traits: AttentionTraits) -> AttentionTraits:
        """``traits`` for this layout's blocks: a window no query's reach exceeds is none.

        Raises:
            ValueError: a window that hides keys from padding that attends (it has no causal positions).
        """
        if traits.window is None:
            return traits
        if traits.window >= self.layout.reach():
            return replace(traits, window=None)
        if self.layout.padding_attends:
            raise ValueError(
                f"this layer uses a sliding window of {traits.window} tokens and padding with targets (labels not "
                f"-100 after the sample) attends over {self.layout.reach()} tokens, which transformers' masks limit "
                "to the window: set the padding's labels to -100, or use recompute='selective'"
            )
        return traits

    def _kernels(self, q: torch.Tensor, v: torch.Tensor, traits: AttentionTraits) -> type[PackedKernels] | None:
        return self.packed or packed_kernels_for(q, v, self.layout, traits)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits
    ) -> tuple[torch.Tensor, AttentionStats]:
        """Output ``(B, h, S, D)`` (zeros on padding that attends to nothing) and the statistics its
        :meth:`backward` needs."""
        traits = self._traits(traits)
        kernels = self._kernels(q, v, traits)
        if kernels is not None:
            return self._packed_forward(kernels, q, k, v, traits)
        out = None
        lses, extras = [], []
        for row, queries, keys, causal in self.layout.blocks(q.shape[0]):
            rows, keys = _part(row, queries), _part(row, keys)
            piece, stats = attention_forward(q[rows], k[keys], v[keys], traits, causal)
            if out is None:
                out = _sequence_major_zeros(q, v.shape[-1], piece.dtype)
            out[rows] = piece
            lses.append(stats.lse.reshape(-1))
            extras.append((stats.lse.shape, stats.extra))
        if out is None:  # only padding: nothing attends
            out = _sequence_major_zeros(q, v.shape[-1], q.dtype)
        lse = torch.cat(lses) if lses else q.new_zeros(0, dtype=torch.float32)
        return out, AttentionStats(lse, tuple(extras), traits.dropout_p)

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
        """``(dq, dk, dv)`` in the shapes, dtypes and memory layouts of ``q, k, v``, zero on padding that is in no
        block, and the ``(h,)`` gradient of ``traits.sinks`` summed over the blocks (``None`` without sinks)."""
        traits = self._traits(traits)
        if stats.extra and stats.extra[0] == "packed":
            return self._packed_backward(grad_out, q, k, v, out, stats, traits)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        sinks = traits.sinks
        dsinks = (
            None
            if sinks is None
            else sinks.new_zeros(sinks.shape, dtype=torch.promote_types(sinks.dtype, torch.float32))
        )
        offset = 0
        for (row, queries, keys, causal), (shape, extra) in zip(self.layout.blocks(q.shape[0]), stats.extra):
            rows, keys = _part(row, queries), _part(row, keys)
            size = shape.numel()
            block_stats = AttentionStats(stats.lse[offset : offset + size].view(shape), extra, stats.dropout_p)
            offset += size
            grad_q, grad_k, grad_v, grad_sinks = attention_backward(
                grad_out[rows], q[rows], k[keys], v[keys], out[rows], block_stats, traits, causal
            )
            dq[rows] += grad_q  # a padding block's keys are its sample's: their gradients add up
            dk[keys] += grad_k
            dv[keys] += grad_v
            if dsinks is not None:
                dsinks += grad_sinks
        return dq, dk, dv, None if dsinks is None else dsinks.to(sinks.dtype)

    def _token_index(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(index, cu, longest)``: the samples' tokens in ``(B * S)`` row-major order, their starts in the packed
        tensor (int32 ``(samples + 1,)``), and the longest sample. Built once per batch size and device (every layer's
        forward and backward of the step use them), on the host, and copied to a CUDA device from pinned memory
        without making the host wait."""
        key = (batch, device)
        if key not in self._indices:
            spans = self.layout.spans(batch)
            starts = [row * self.layout.length + start for row, (start, _) in spans]
            lengths = [stop - start for _, (start, stop) in spans]
            index = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lengths)]) if spans else torch.zeros(0)
            cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            index = index.to(torch.long)
            if device.type == "cuda":
                index, cu = index.pin_memory(), cu.pin_memory()
            index, cu = (t.to(device, non_blocking=True) for t in (index, cu))
            self._indices[key] = index, cu, max(lengths, default=0)
        return self._indices[key]

    def _packed_forward(
        self,
        kernels: type[PackedKernels],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        traits: AttentionTraits,
    ) -> tuple[torch.Tensor, AttentionStats]:
        dtype = compute_dtype(q, k, v)  # as attention_forward: autocast's dtype, or the inputs'
        index, cu, longest = self._token_index(q.shape[0], q.device)
        q_p, k_p, v_p = (_packed(t.to(dtype), index) for t in (q, k, v))
        p = traits.dropout_p
        with torch.no_grad():
            out_p, lse, extra = kernels.forward(q_p, k_p, v_p, cu, longest, traits.scale, p, traits.window)
            if traits.sinks is not None:
                apply_sinks_(_heads_first(out_p), lse[None], traits.sinks)
        out = _sequence_major_zeros(q, v.shape[-1], out_p.dtype)
        out.transpose(1, 2).reshape(-1, *out_p.shape[1:]).index_copy_(0, index, out_p)  # a view of out's memory
        return out, AttentionStats(lse, ("packed", kernels, extra), p)

    def _packed_backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        stats: AttentionStats,
        traits: AttentionTraits,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        _, kernels, extra = stats.extra
        index, cu, longest = self._token_index(q.shape[0], q.device)
        packed = [_packed(t.to(out.dtype), index) for t in (grad_out, q, k, v, out)]
        grads = kernels.backward(*packed, stats.lse, extra, cu, longest, traits.scale, stats.dropout_p, traits.window)
        dq, dk, dv = (_unpacked(g, index, like) for g, like in zip(grads, (q, k, v)))
        if traits.sinks is None:
            return dq, dk, dv, None
        grad_p, out_p = packed[0], packed[-1]
        return dq, dk, dv, sinks_grad(_heads_first(grad_p), _heads_first(out_p), stats.lse[None], traits.sinks)


def _heads_first(packed: torch.Tensor) -> torch.Tensor:
    """A packed ``(total, h, D)`` tensor as a ``(1, h, total, D)`` view."""
    return packed.transpose(0, 1)[None]


def _packed(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The samples' tokens of ``t`` ``(B, h, S, D)`` as one contiguous ``(total, h, D)`` tensor."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[-1]).index_select(0, index)


def _unpacked(packed: torch.Tensor, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``packed`` ``(total, h, D)`` scattered back into a zero tensor of ``like``'s shape ``(B, h, S, D)``, layout and
    dtype (padding: zero)."""
    batch, heads, length, dim = like.shape
    flat = packed.new_zeros(batch * length, heads, dim).index_copy_(0, index, packed)
    return torch.empty_like(like).copy_(flat.view(batch, length, heads, dim).transpose(1, 2))


def _part(row: int, span: tuple[int, int]) -> tuple[slice, slice, slice]:
    """The index of ``span``'s tokens of ``row`` in a ``(B, h, S, D)`` tensor."""
    return slice(row, row + 1), slice(None), slice(*span)


def _sequence_major_zeros(q: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros ``(B, h, S, head_dim)`` laid out as ``(B, S, h, head_dim)`` memory."""
    batch, heads, length, _ = q.shape
    return q.new_zeros(batch, length, heads, head_dim, dtype=dtype).transpose(1, 2)


def attention_core_for(layout: BatchLayout | None) -> LocalAttention | VarlenAttention:
    """The core for a step's rows: whole-row causal attention when each row is one sample, else per sample."""
    return LocalAttention() if layout is None or layout.plain else VarlenAttention(layout)


# What transformers' attention functions read about the samples of a whole row (flash-attention's varlen
# arguments, as DataCollatorWithFlattening can write them): meaningless for a call on one sample.
ROW_KEYWORDS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def attend_per_sample(
    attend: Callable[..., tuple[torch.Tensor, Any]],
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: BatchLayout,
    kwargs: dict,
) -> torch.Tensor:
    """A transformers attention function, causal without a mask, run once per sample of ``layout`` (with autograd).

    Args:
        attend: e.g. ``ALL_ATTENTION_FUNCTIONS["sdpa"]``: ``attend(module, q, k, v, None, **kwargs)[0]``.
        query: ``(B, h, S, D)``; key, value: ``(B, h_kv, S, D)`` (whole rows).
        kwargs: passed on (scaling, dropout, ...), except :data:`ROW_KEYWORDS`.

    Returns:
        ``(B, S, h, D)``, zeros on padding: no ``S x S`` mask is built and padding costs nothing.
    """
    kwargs = {name: value for name, value in kwargs.items() if name not in ROW_KEYWORDS}
    if layout.plain:
        return attend(module, query, key, value, None, **kwargs)[0]
    batch, heads, length, _ = query.shape
    output = query.new_zeros(batch, length, heads, value.shape[-1])
    for row, (start, stop) in layout.spans(batch):
        part = slice(row, row + 1), slice(None), slice(start, stop)
        output[row : row + 1, start:stop] = attend(module, query[part], key[part], value[part], None, **kwargs)[0]
    return output
