"""A DSA solution (byte offsets per tensor) and the check every solution passes before it is used."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hf_memo.planner.lifetimes import Trace


@dataclass(frozen=True)
class DSASolution:
    """Offsets for the tensors of a trace, in one arena.

    Attributes:
        offsets: byte offset of every tensor, by tensor id; multiples of ``alignment``.
        peak: bytes the arena needs, ``max(offset + size rounded up to alignment)``.
        lower_bound: most bytes live at once (sizes rounded up to ``alignment``); ``peak >= lower_bound``.
        optimal: ``True`` only when no placement can have a smaller peak (proven).
        solver: the method that produced the offsets (``"cpsat"``, ``"greedy"``, ``"mip"``, ``"gurobi"``).
        seconds: wall time of the solve.
        alignment: bytes every size is rounded up to and every offset is a multiple of.
        status: what happened, in words (e.g. ``"optimal: peak equals the lower bound"``).
    """

    offsets: dict[int, int]
    peak: int
    lower_bound: int
    optimal: bool
    solver: str
    seconds: float
    alignment: int
    status: str = ""

    @property
    def ratio(self) -> float:
        """``peak / lower_bound`` (1.0 for an empty trace)."""
        return self.peak / self.lower_bound if self.lower_bound else 1.0

    def stats(self) -> dict[str, Any]:
        """Everything but the offsets, JSON-serialisable."""
        return {
            "tensors": len(self.offsets),
            "peak": self.peak,
            "lower_bound": self.lower_bound,
            "ratio": round(self.ratio, 6),
            "optimal": self.optimal,
            "solver": self.solver,
            "seconds": round(self.seconds, 4),
            "alignment": self.alignment,
            "status": self.status,
        }


def find_conflict(start: np.ndarray, end: np.ndarray, size: np.ndarray, offset: np.ndarray) -> tuple[int, int] | None:
    """The first pair ``(i, j)`` of boxes alive together whose memory ``[offset, offset + size)`` overlaps, or ``None``.

    All arrays have shape ``(n,)``; box ``i`` lives over ``[start[i], end[i])``.
    """
    order = np.argsort(start, kind="stable")
    start, end, size, offset = start[order], end[order], size[order], offset[order]
    # Sorted by start, box k meets in time exactly the boxes after it that start before it ends.
    for k in range(len(start)):
        later = slice(k + 1, int(np.searchsorted(start, end[k], side="left")))
        clash = np.flatnonzero((offset[later] < offset[k] + size[k]) & (offset[k] < offset[later] + size[later]))
        if clash.size:
            return int(order[k]), int(order[k + 1 + clash[0]])
    return None


def check_placement(trace: Trace, offsets: Mapping[int, int], alignment: int = 1) -> int:
    """Check that ``offsets`` place every tensor of ``trace`` without conflicts; return the peak in bytes.

    Tensors occupy ``[offset, offset + size rounded up to alignment)``. Raises ``ValueError`` naming the
    tensor(s) when an offset is missing, negative or unaligned, or when two tensors whose lifetimes
    intersect overlap in memory.
    """
    if not trace.lifetimes:
        return 0
    lives = trace.lifetimes
    missing = [life.tensor_id for life in lives if life.tensor_id not in offsets]
    if missing:
        raise ValueError(f"no offset for tensor(s) {missing[:10]}")
    start = np.array([life.start for life in lives], dtype=np.int64)
    end = np.array([life.end for life in lives], dtype=np.int64)
    size = np.array([-(-life.size // alignment) * alignment for life in lives], dtype=np.int64)
    offset = np.array([offsets[life.tensor_id] for life in lives], dtype=np.int64)
    for life, at in zip(lives, offset):
        if at < 0 or at % alignment:
            raise ValueError(f"tensor {life.tensor_id} has offset {at}, not a multiple of {alignment} >= 0")
    conflict = find_conflict(start, end, size, offset)
    if conflict is not None:
        a, b = (lives[k] for k in conflict)
        oa, ob = offsets[a.tensor_id], offsets[b.tensor_id]
        raise ValueError(
            f"tensors {a.tensor_id} (events [{a.start}, {a.end}), bytes [{oa}, {oa + size[conflict[0]]})) and "
            f"{b.tensor_id} (events [{b.start}, {b.end}), bytes [{ob}, {ob + size[conflict[1]]})) "
            "are alive at the same time and overlap in memory"
        )
    return int((offset + size).max())
