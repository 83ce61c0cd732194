"""Mini-sequence MLP (MsT algorithms 1 and 3): the ``(S, I)`` intermediates never exist at full length."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.minseq.recompute import run_chunked


def minseq_mlp(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, params: Sequence[torch.Tensor], chunks: int) -> Any:
    """Apply a per-token function ``fn`` (the MLP, dense or mixture of experts) to ``x`` in ``chunks`` mini-sequences.

    Forward keeps only ``x``; backward recomputes one chunk's ``(S / chunks, I)`` intermediates at a
    time, with or without Hugging Face gradient checkpointing around it.

    The leading dims of ``x`` are flattened into ``N`` token rows (batch-major) and each chunk is a ``(1, n, H)``
    view of consecutive rows: the 3-D shape a mixture-of-experts block expects (it flattens its input to rows
    itself), rows in the order in which transformers' routers see a whole batch, so per-row outputs of the chunks
    concatenate into exactly the unchunked ones, and chunks of equal size whatever the batch and sequence shape. A
    dense MLP computes the same matmuls on ``(1, n, H)`` as on ``(n, H)``.

    Args:
        fn: the MLP on one mini-sequence, ``(1, n, H) -> (1, n, H_out)``, independent across tokens (dropout
            allowed); or returning a tuple of that and per-row tensors ``(n, ...)`` in the order of the flattened
            rows (a mixture-of-experts block's router outputs, e.g. ``(n, E)`` logits or ``(n, k)`` scores).
        x: input ``(..., H)``, e.g. ``(B, S, H)``.
        params: the tensors ``fn`` uses that may need gradients (the MLP's trainable parameters).
        chunks: number of mini-sequences (clamped to the row count). ``1`` calls ``fn`` on ``x`` as is.

    Returns:
        ``fn(x)``: ``(..., H_out)``, or for a tuple-valued ``fn`` that first, then each per-row output over all
        ``N`` rows ``(N, ...)``. Gradients through any of the outputs are those of the unchunked call.
    """
    if chunks == 1:
        return fn(x)  # as is, without flattening: bitwise the unpatched MLP
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)
    out = run_chunked(_per_row(fn), rows, params, chunk_bounds(rows.shape[0], chunks), "cat")
    if isinstance(out, tuple):
        return (out[0].reshape(*lead, out[0].shape[-1]), *out[1:])
    return out.reshape(*lead, out.shape[-1])


def _per_row(fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor, int, int], Any]:
    """``fn`` on a chunk of rows ``(n, H)`` seen as ``(1, n, H)``, its per-token output back as rows ``(n, H_out)``."""

    def chunk(rows: torch.Tensor, _start: int, _stop: int) -> Any:
        out = fn(rows.unsqueeze(0))
        if isinstance(out, tuple):
            return (out[0].squeeze(0), *out[1:])
        return out.squeeze(0)

    return chunk
