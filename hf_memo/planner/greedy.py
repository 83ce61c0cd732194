"""Greedy DSA: largest tensor first, each into the tightest gap that fits (best fit). Milliseconds.

Tensors are boxes with a fixed time span ``[start, end)`` and a ``size``; the greedy places them in
decreasing size (ties: longer lifetime first, then earlier start). For each one it looks at the
already placed tensors whose lifetimes intersect its own, and puts it into the smallest free gap
between them that is large enough (lowest offset on ties), or on top of them when none is.
"""

from __future__ import annotations

import numpy as np


def best_fit_offsets(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Offsets (same unit as ``size``) for boxes ``[start, end) x size``, all arrays of shape ``(n,)``."""
    n = len(size)
    offsets = np.zeros(n, dtype=np.int64)
    order = sorted(range(n), key=lambda i: (-size[i], -(end[i] - start[i]), start[i], i))
    placed = np.zeros(n, dtype=bool)
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
                best = fitting[np.argmin(gaps[fitting])]
                offsets[i] = gap_starts[best]
            else:
                offsets[i] = tops[-1]
        placed[i] = True
    return offsets
