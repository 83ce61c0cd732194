"""Which tokens of a causal-LM batch attend to which: the samples of each row, padding left out.

A row of a training batch holds one sample, one sample with padding (``attention_mask`` zeros at
its left and/or right), or several packed samples (``position_ids`` restarting, or jumping, at each
sample's first token, as transformers' ``DataCollatorWithFlattening`` and TRL's padding-free
collators write them). A :class:`BatchLayout` lists each row's samples as ``[start, stop)`` spans,
``cu_seqlens``-style: a token attends causally to the tokens of its own span; padding tokens are in
no span and are attended by nothing. A padding token attends to nothing (its attention output is
zero, as PyTorch's SDPA gives a query whose keys are all masked), except where the labels give
padding after a row's sample a target (``padding_attends``): those padding queries attend to every
token of the sample before them, as transformers' causal-and-padding masks let them (see
:meth:`BatchLayout.blocks`).

:func:`describe_batch` derives it once per training step, reading the mask, the positions and the
targets to the host in one transfer (none at all for a batch with neither mask nor positions), and
refuses what transformers' own attention would get wrong or what a layout cannot express. The
layout then travels to the attention calls under :data:`LAYOUT_KEYWORD`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Span = tuple[int, int]
Block = tuple[int, Span, Span, bool]
"""``(row, queries, keys, causal)``: queries ``[start, stop)`` of a row attend to its keys ``[start, stop)``,
causally (query ``i`` to keys up to ``i``) or to all of them."""


@dataclass(frozen=True)
class BatchLayout:
    """The samples of every row of a ``(B, S)`` batch.

    Attributes:
        length: ``S``, the row length.
        rows: per row, the ``(start, stop)`` span of each sample in order; ``None`` when every row is
            one sample over the whole row (plain causal attention, nothing to look up).
        padding_attends: a padding token after a row's sample has a target in the labels. transformers'
            masks (causal and padding) let every padding query after the sample attend to all of that
            sample's tokens, and the loss trains those queries, so the padding after each row's (only)
            sample attends to it here too (:meth:`blocks`). Rows then hold at most one sample.
    """

    length: int
    rows: tuple[tuple[Span, ...], ...] | None = None
    padding_attends: bool = False

    @property
    def plain(self) -> bool:
        """Every row is one causal sequence over all ``S`` tokens."""
        return self.rows is None

    @property
    def packed(self) -> bool:
        """Some row holds more than one sample."""
        return self.rows is not None and any(len(spans) > 1 for spans in self.rows)

    def spans(self, batch: int) -> list[tuple[int, Span]]:
        """``(row, span)`` of every sample of a ``batch``-row batch, row by row."""
        if self.rows is None:
            return [(row, (0, self.length)) for row in range(batch)]
        return [(row, span) for row, spans in enumerate(self.rows) for span in spans]

    def blocks(self, batch: int) -> list[Block]:
        """Every attention block of a ``batch``-row batch, row by row: each sample causally over itself, and with
        ``padding_attends`` the padding after a row's sample (queries ``[stop, S)``) over all of that sample's
        tokens (keys ``[start, stop)``, not causal: every key precedes every such query).

        This is exactly what transformers' causal mask combined with a right-padding ``attention_mask`` computes
        for those rows (a padding query at position ``p`` sees the real keys up to ``p``); padding before a
        sample and padding in a row without a sample attend to nothing.
        """
        blocks: list[Block] = [(row, span, span, True) for row, span in self.spans(batch)]
        if self.padding_attends and self.rows is not None:
            for row, spans in enumerate(self.rows):
                if spans and spans[-1][1] < self.length:
                    start, stop = spans[-1]
                    blocks.append((row, (stop, self.length), (start, stop), False))
        return blocks

    def longest(self) -> int:
        """Tokens of the longest sample."""
        if self.rows is None:
            return self.length
        return max((stop - start for spans in self.rows for start, stop in spans), default=0)

    def reach(self) -> int:
        """Tokens from the farthest key any query attends to up to that query, inclusive: the longest sample, or,
        where padding attends (``padding_attends``), from a row's sample start to the row's end (its last
        padding query attends to the sample's first token)."""
        if self.rows is None:
            return self.length
        if not self.padding_attends:
            return self.longest()
        return max((self.length - spans[-1][0] for spans in self.rows if spans), default=0)

    def attended_pairs(self, batch: int) -> int:
        """(query, key) pairs causal attention computes: ``Σ s (s + 1) / 2`` over the samples."""
        return sum((stop - start) * (stop - start + 1) // 2 for _, (start, stop) in self.spans(batch))

    def real_tokens(self, batch: int) -> int:
        """Tokens that belong to a sample (not padding)."""
        return sum(stop - start for _, (start, stop) in self.spans(batch))

    def padded_to(self, length: int) -> BatchLayout:
        """The same samples in rows extended to ``length >= S`` tokens at the end.

        A plain layout stays plain (a causal token never attends to later ones); otherwise the new
        tokens are padding (attending like the row's other padding after its sample).
        """
        return BatchLayout(length, self.rows, self.padding_attends)


LAYOUT_KEYWORD = "hf_memo_layout"
"""The keyword a training step's layout travels under, from the causal LM's forward through the backbone and its
decoder layers (transformers passes their ``**kwargs`` on) to every attention call, recomputations included."""


def describe_batch(
    batch: int,
    length: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> BatchLayout:
    """The :class:`BatchLayout` of a ``(B, S)`` training batch.

    Args:
        batch, length: ``B`` and ``S``.
        attention_mask: ``(B, S)`` ones for real tokens, zeros for padding; the real tokens of a row
            must be contiguous (left and/or right padding).
        position_ids: ``(B, S)`` or ``(1, S)``; a real token whose position is not its predecessor's
            plus one starts a new sample (transformers' packed-sequence rule).
        shift_labels: ``(B, S)`` next-token targets (``ignore_index`` for none), to check that no
            padding token after a real one has a target.

    A padding token after real ones with a target (transformers lets it attend to the real tokens
    before it) sets ``padding_attends`` (see :meth:`BatchLayout.blocks`). Padding together with
    packed samples gives a layout, though transformers' own masks would let those samples attend to
    each other (see :func:`needs_masks_transformers_lacks`).

    Raises:
        ValueError: a mask that is not 2-D or not left/right padding.
    """
    if attention_mask is None and position_ids is None:
        return BatchLayout(length)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"a training batch's attention_mask must be 2-D (batch, seq_len) padding, got shape "
            f"{tuple(attention_mask.shape)}; pack samples with position_ids instead of a custom mask"
        )
    device = (attention_mask if attention_mask is not None else position_ids).device
    mask = torch.ones(batch, length, dtype=torch.int64, device=device) if attention_mask is None else attention_mask
    positions = torch.arange(length, device=device).expand(batch, length) if position_ids is None else position_ids
    counted = torch.zeros_like(mask) if shift_labels is None else (shift_labels != ignore_index)
    host = torch.stack([t.to(device, torch.int64).expand(batch, length) for t in (mask, positions, counted)]).cpu()
    return _layout_from_host(host[0].bool(), host[1], host[2].bool(), attention_mask is not None)


def needs_masks_transformers_lacks(layout: BatchLayout, batch: int) -> bool:
    """Padding and packed samples together: transformers then skips packed-sequence detection (it does so
    whenever an attention mask is given), so only per-sample attention keeps these samples apart."""
    return layout.packed and layout.real_tokens(batch) < batch * layout.length


def _layout_from_host(real: torch.Tensor, positions: torch.Tensor, counted: torch.Tensor, masked: bool) -> BatchLayout:
    """The layout from host tensors ``(B, S)``: real-token mask, positions, counted targets."""
    batch, length = real.shape
    previous_real = torch.zeros_like(real)
    previous_real[:, 1:] = real[:, :-1]
    if bool(((real & ~previous_real).sum(dim=1) > 1).any()):
        raise ValueError(
            "attention_mask must mark left and/or right padding (each row: zeros, ones, zeros), but a row has "
            "masked tokens between real ones; pack samples with position_ids restarting at 0 instead"
        )
    jumps = torch.ones_like(real)
    jumps[:, 1:] = positions.diff(dim=1) != 1
    starts = real & (jumps | ~previous_real)
    padded = masked and not bool(real.all())
    padding_attends = bool((counted & ~real & (real.cumsum(dim=1) > 0)).any())
    if not padded and int(starts.sum()) == batch:
        return BatchLayout(length)
    rows = []
    for row in range(batch):
        first = starts[row].nonzero().flatten().tolist()
        stop = int(real[row].nonzero().max()) + 1 if first else 0
        rows.append(tuple(zip(first, first[1:] + [stop])))
    return BatchLayout(length, tuple(rows), padding_attends)
