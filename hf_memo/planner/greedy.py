"""Greedy DSA: place tensors one by one into a gap between those already placed. Milliseconds.

Tensors are boxes with a fixed time span ``[start, end)`` and a ``size``. Taken in some order, each
one goes into a free gap between the already placed tensors whose lifetimes intersect its own —
the smallest gap large enough (best fit) or the lowest (first fit) — or on top of them when none is.

:func:`best_fit_offsets` is the classic rule (largest first, best fit), the ``"greedy"`` solver.
:func:`best_greedy_offsets` runs a few orders and fits and keeps the lowest placement: the start of
the exact solvers, which need not run at all when it reaches the lower bound. Of 20 level-1 and
level-2 problems of profiled Llama-3-8B and GPT-7B steps (32K and 128K tokens, memo and mini-sequence
modes) where largest-first best fit missed the bound, the other orders and first fit reached it in 11.
"""

from __future__ import annotations

import numpy as np


def _place(start: np.ndarray, end: np.ndarray, size: np.ndarray, order: np.ndarray, best: bool) -> np.ndarray:
    """Offsets of boxes placed in ``order`` into the smallest (``best``) or lowest fitting gap."""
    offsets = np.zeros(len(size), dtype=np.int64)
    placed = np.zeros(len(size), dtype=bool)
    for i in order:
        neighbours = np.flatnonzero(placed & (start < end[i]) & (end > start[i]))
        if neighbours.size:
            by_offset = neighbours[np.argsort(offsets[neighbours], kind="stable")]
            lows = offsets[by_offset]
            tops = np.maximum.accumulate(lows + size[by_offset])
            gap_starts = np.concatenate(([0], tops[:-1]))
            gaps = lows - gap_starts
            fitting = np.flatnonzero(gaps >= size[i])
            if fitting.size:
                chosen = fitting[np.argmin(gaps[fitting])] if best else fitting[0]
                offsets[i] = gap_starts[chosen]
            else:
                offsets[i] = tops[-1]
        placed[i] = True
    return offsets


def _order(*keys: np.ndarray) -> np.ndarray:
    """Indices sorted by ``keys`` (the first key most significant), ties by index."""
    return np.lexsort((np.arange(len(keys[0])), *reversed(keys)))


def best_fit_offsets(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Largest first (ties: longer lifetime, then earlier start), best fit; arrays of shape ``(n,)``."""
    return _place(start, end, size, _order(-size, -(end - start), start), best=True)


def best_greedy_offsets(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> np.ndarray:
    """The lowest of :func:`best_fit_offsets` and greedy placements by lifetime and by size x lifetime."""
    duration = end - start
    candidates = [best_fit_offsets(start, end, size)]
    largest_first = _order(-size, -duration, start)
    candidates.append(_place(start, end, size, largest_first, best=False))
    for order in (_order(-duration, -size, start), _order(-size * duration, start)):
        candidates += [_place(start, end, size, order, best=True), _place(start, end, size, order, best=False)]
    return min(candidates, key=lambda offsets: int((offsets + size).max()))
