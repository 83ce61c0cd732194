"""The longest sequence that trains: galloping then bisection on a grid, resumable from recorded outcomes.

``fits`` maps sequence lengths already run to what they showed: ``True`` (trained), ``False`` (ran
out of device memory: does not fit) or ``None`` (undecided: it timed out, was predicted too slow, ran
out of host or pinned memory, or failed otherwise). The next length to run is a pure function of it,
so a search interrupted and restarted asks for the same lengths again and finds them recorded.
Fitting is assumed monotone: if a length fits, every shorter one does. Only device memory bounds the
answer from above: below an undecided length the search still bisects, and its answer is then a
lower bound (reported as "≥").
"""

from __future__ import annotations

from dataclasses import dataclass


def length_grid(step: int, maximum: int) -> list[int]:
    """``[step, 2 * step, ..., maximum]``; ``maximum`` must be a multiple of the step."""
    if step < 1 or maximum < step or maximum % step:
        raise ValueError(f"grid maximum must be a positive multiple of the step, got step={step}, maximum={maximum}")
    return list(range(step, maximum + 1, step))


def _bounds(fits: dict[int, bool | None]) -> tuple[int | None, int | None, int | None]:
    """(longest length that fits, shortest device-OOM length above it, shortest undecided length above it)."""
    fitting = [s for s, ok in fits.items() if ok]
    longest = max(fitting) if fitting else None
    above = [s for s in fits if longest is None or s > longest]
    failing = min((s for s in above if fits[s] is False), default=None)
    undecided = min((s for s in above if fits[s] is None), default=None)
    return longest, failing, undecided


def next_length(grid: list[int], fits: dict[int, bool | None]) -> int | None:
    """The grid length to run next, or ``None`` when nothing is left to learn.

    With nothing failed or undecided above the longest fitting length, the length doubles
    (galloping, so the long and slow lengths are reached only when shorter ones fit); then the gap
    below the shortest failed or undecided length is halved.
    """
    below, failing, undecided = _bounds(fits)
    ceiling = min((s for s in (failing, undecided) if s is not None), default=None)
    if ceiling is None:
        if below is None:
            return grid[0]
        longer = [s for s in grid if below < s <= 2 * below] or [s for s in grid if s > below][:1]
        return longer[-1] if longer else None
    gap = [s for s in grid if (below is None or s > below) and s < ceiling]
    return gap[(len(gap) - 1) // 2] if gap else None


@dataclass(frozen=True)
class Longest:
    """Result of the search.

    Attributes:
        seq_len: the longest grid length that trained, ``None`` if none did (or none ran yet).
        complete: the search has no length left to run.
        exact: ``seq_len`` is the limit: the search is complete and the next grid length ran out of
            device memory (with ``seq_len`` ``None``: the first grid length did). Otherwise ``seq_len``
            is a lower bound: the next length timed out or failed another way, the grid ended (the true
            limit may be longer), or the search is not finished.
    """

    seq_len: int | None
    complete: bool
    exact: bool


def longest(grid: list[int], fits: dict[int, bool | None]) -> Longest:
    below, failing, undecided = _bounds(fits)
    complete = next_length(grid, fits) is None
    exact = complete and failing is not None and (undecided is None or failing < undecided)
    return Longest(below, complete, exact)
