"""The longest sequence that trains: galloping then bisection on a grid, resumable from recorded outcomes.

``fits`` maps sequence lengths already run to whether they trained. The next length to run is a
pure function of it, so a search interrupted and restarted asks for the same lengths again and
finds them recorded. Fitting is assumed monotone: if a length fits, every shorter one does.
"""

from __future__ import annotations

from dataclasses import dataclass


def length_grid(step: int, maximum: int) -> list[int]:
    """``[step, 2 * step, ..., maximum]``; ``maximum`` must be a multiple of ``step``."""
    if step < 1 or maximum < step or maximum % step:
        raise ValueError(f"grid maximum must be a positive multiple of the step, got step={step}, maximum={maximum}")
    return list(range(step, maximum + 1, step))


def _bounds(grid: list[int], fits: dict[int, bool]) -> tuple[int | None, int | None]:
    """(longest length that fits, shortest failing length above it); ``None`` where unknown."""
    fitting = [s for s, ok in fits.items() if ok]
    longest = max(fitting) if fitting else None
    failing = [s for s, ok in fits.items() if not ok and (longest is None or s > longest)]
    return longest, (min(failing) if failing else None)


def next_length(grid: list[int], fits: dict[int, bool]) -> int | None:
    """The grid length to run next, or ``None`` when the answer is known.

    With no failure above the longest fitting length, the length doubles (galloping, so the long
    and slow lengths are reached only when shorter ones fit); then the gap is halved.
    """
    below, above = _bounds(grid, fits)
    if above is None:
        if below is None:
            return grid[0]
        longer = [s for s in grid if below < s <= 2 * below] or [s for s in grid if s > below][:1]
        return longer[-1] if longer else None
    gap = [s for s in grid if (below is None or s > below) and s < above]
    return gap[(len(gap) - 1) // 2] if gap else None


@dataclass(frozen=True)
class Longest:
    """Result of the search.

    Attributes:
        seq_len: the longest grid length that trained, ``None`` if none did (or none ran yet).
        complete: the search has no length left to run.
        at_grid_max: ``seq_len`` is the grid's end, so the true limit may be longer.
    """

    seq_len: int | None
    complete: bool
    at_grid_max: bool


def longest(grid: list[int], fits: dict[int, bool]) -> Longest:
    below, _ = _bounds(grid, fits)
    return Longest(below, next_length(grid, fits) is None, below is not None and below >= grid[-1])
