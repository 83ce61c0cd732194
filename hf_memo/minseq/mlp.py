"""Mini-sequence MLP (MsT algorithms 1 and 3): the ``(S, I)`` intermediates never exist at full length."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.minseq.recompute import run_chunked


def minseq_mlp(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor], chunks: int
) -> torch.Tensor:
    """Apply a per-token function ``fn`` (the MLP) to ``x`` in ``chunks`` mini-sequences.

    Forward keeps only ``x``; backward recomputes one chunk's ``(S / chunks, I)`` intermediates at a
    time, with or without Hugging Face gradient checkpointing around it.

    Args:
        fn: the MLP, ``(n, H) -> (n, H_out)``, independent across rows (dropout allowed).
        x: input ``(..., H)``, e.g. ``(B, S, H)``; all leading dims are flattened into rows.
        params: the tensors ``fn`` uses that may need gradients (the MLP's trainable parameters).
        chunks: number of mini-sequences (clamped to the row count). ``1`` calls ``fn`` as is.

    Returns:
        ``(..., H_out)``, equal to ``fn(x)``.
    """
    if chunks == 1:
        return fn(x)  # as is, without flattening: bitwise the unpatched MLP
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)
    out = run_chunked(lambda chunk, _start, _stop: fn(chunk), rows, params, chunk_bounds(rows.shape[0], chunks), "cat")
    return out.reshape(*lead, out.shape[-1])
