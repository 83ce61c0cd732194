"""How many mini-sequences to cut a sequence into, and where the cuts go."""

from __future__ import annotations

import math


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """Half-open ``(start, stop)`` row ranges that cover ``range(rows)`` exactly, in order.

    Sizes differ by at most one row, so no tail is dropped when ``chunks`` does not divide
    ``rows``. More chunks than rows gives one row per chunk; zero rows gives one empty chunk.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    chunks = max(1, min(chunks, rows))
    return [(i * rows // chunks, (i + 1) * rows // chunks) for i in range(chunks)]


def auto_chunks(tokens: int, width: int, hidden: int, min_chunk_tokens: int, max_chunk_elements: int) -> int:
    """Chunks for an op whose intermediate is ``(tokens, width)`` while its input is ``(tokens, hidden)``.

    Aims at ``ceil(width / hidden)`` so each chunk's intermediate is about the size of the hidden
    state (the Mini-Sequence Transformer rule), and at more chunks when that would leave a chunk's
    intermediate above ``max_chunk_elements`` (long sequences: the transient of one chunk stays
    bounded however long the sequence is). It prefers the first count up to twice that which divides
    ``tokens`` (equal chunks give equal tensors, which the memory planner packs tightly), and never
    cuts chunks shorter than ``min_chunk_tokens``: short sequences get one chunk and run exactly as
    before (that rule wins over ``max_chunk_elements``).
    """
    largest_chunk = max(1, max_chunk_elements // width)
    target = max(math.ceil(width / hidden), math.ceil(tokens / largest_chunk))
    limit = tokens // min_chunk_tokens
    if limit <= 1:
        return 1
    for chunks in range(target, min(2 * target, limit) + 1):
        if tokens % chunks == 0:
            return chunks
    return min(target, limit)


def resolve_chunks(
    setting: int | str, tokens: int, width: int, hidden: int, min_chunk_tokens: int, max_chunk_elements: int
) -> int:
    """The chunk count for a ``MemoConfig`` setting (an int, or ``"auto"``)."""
    if setting == "auto":
        return auto_chunks(tokens, width, hidden, min_chunk_tokens, max_chunk_elements)
    return int(setting)
