"""``solve_dsa``: offline Dynamic Storage Allocation of a trace, exact where it can be, never failing.

Before any solver runs, two exact reductions shrink the problem:

* a tensor whose lifetime intersects every other tensor's can go at the bottom: every other tensor
  is below or above it in every placement, so moving those above it down and stacking it under
  them changes nothing (parameters and other whole-step tensors vanish this way);
* tensors that split into groups with disjoint time spans are independent problems; the peak is
  the largest group peak, so a group whose greedy peak is already below another group's lower bound
  needs no exact solve at all.

Each remaining group is placed by the greedy (best fit, largest first) and, if its peak is above
what the other groups force anyway by more than :data:`NEAR_OPTIMAL` of it, by the exact solver, whose
peak is bounded above by the greedy's and which stops once within that share of its proven bound. A
placement that close to a lower bound is as good as optimal for memory (1e-4 of 64 GiB is 6.4 MiB,
three of the CUDA caching allocator's 2 MiB segment roundings); proving the last few hundred bytes
optimal took CP-SAT its whole time limit on a 626-tensor step whose greedy peak was 1 KiB above the
lower bound. Every solution is checked, and so is the combined placement; a missing solver, a license
refusal, a timeout or a failed check falls back to the best valid placement found, with a
:class:`PlannerWarning` — never an exception.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from hf_memo.planner.cpsat import cpsat_offsets
from hf_memo.planner.exact import ExactResult, SolverUnavailable
from hf_memo.planner.greedy import best_fit_offsets, best_greedy_offsets
from hf_memo.planner.lifetimes import Trace
from hf_memo.planner.mip import gurobi_offsets, milp_offsets
from hf_memo.planner.solution import DSASolution, check_placement, find_conflict

SOLVERS = ("cpsat", "greedy", "mip", "gurobi")
# Where a solver goes when it cannot run: Gurobi to the other exact solver, the others to the greedy.
_FALLBACK = {"gurobi": "cpsat", "cpsat": "greedy", "mip": "greedy"}
_MAX_DEPTH = 100  # nested reductions deeper than this are solved as they stand (keeps recursion shallow)
NEAR_OPTIMAL = 1e-4  # a placement within this share of a proven lower bound ends the search (module docstring)


class PlannerWarning(UserWarning):
    """The planner fell back to a weaker plan (solver missing, refused, out of time, or invalid answer)."""


def max_live(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> int:
    """Most ``size`` alive at once over boxes ``[start, end)``, arrays of shape ``(n,)``."""
    if len(size) == 0:
        return 0
    times = np.concatenate((start, end))
    changes = np.concatenate((size, -size))
    order = np.lexsort((changes, times))  # at equal times, frees (negative) before mallocs
    return int(np.cumsum(changes[order]).max())


@dataclass
class _Search:
    """Settings and bookkeeping shared by the groups of one solve."""

    solver: str
    deadline: float
    workers: int
    seed: int
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Placed:
    offsets: np.ndarray  # shape (n,), relative to the group's bottom
    peak: int
    bound: int  # proven lower bound on the group's optimal peak


def _universal(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Mask of the boxes whose time span intersects every other box's."""
    n = len(start)
    if n <= 1:
        return np.ones(n, dtype=bool)
    order_end, order_start = np.argsort(end), np.argsort(-start)
    # For each box, the earliest end and the latest start among the *other* boxes.
    min_end = np.where(np.arange(n) == order_end[0], end[order_end[1]], end[order_end[0]])
    max_start = np.where(np.arange(n) == order_start[0], start[order_start[1]], start[order_start[0]])
    return (start < min_end) & (end > max_start)


def _components(start: np.ndarray, end: np.ndarray) -> list[np.ndarray]:
    """Indices of the groups of boxes connected through intersecting time spans."""
    order = np.argsort(start, kind="stable")
    groups, current, reach = [], [], None
    for i in order:
        if current and start[i] >= reach:
            groups.append(np.array(current))
            current, reach = [], None
        current.append(i)
        reach = end[i] if reach is None else max(reach, end[i])
    if current:
        groups.append(np.array(current))
    return groups


def _exact(search: _Search, solver: str, start, end, size, hint, floor) -> ExactResult:
    remaining = search.deadline - time.perf_counter()
    if solver == "cpsat":
        return cpsat_offsets(start, end, size, hint, floor, remaining, search.workers, search.seed, NEAR_OPTIMAL)
    if solver == "mip":
        return milp_offsets(start, end, size, hint, floor, remaining)
    return gurobi_offsets(start, end, size, hint, floor, remaining, search.workers, search.seed)


def _solve_leaf(search: _Search, start, end, size, floor: int) -> _Placed:
    """One group without reducible structure, in units of the gcd of its sizes (see :func:`_solve_scaled`)."""
    unit = int(np.gcd.reduce(size))
    placed = _solve_scaled(search, start, end, size // unit, -(-floor // unit))
    return _Placed(placed.offsets * unit, placed.peak * unit, placed.bound * unit)


def _solve_scaled(search: _Search, start, end, size, floor: int) -> _Placed:
    """Greedy, then the exact solver if it can still matter.

    Called with sizes divided by their gcd ``g``: exact, since pushing every box down as far as it goes
    (lowest first) keeps a placement valid and its peak, and leaves every offset a sum of sizes, a
    multiple of ``g``. Layer tensors are multiples of large powers of two, so the solver's numbers
    shrink by orders of magnitude.
    """
    greedy = (best_fit_offsets if search.solver == "greedy" else best_greedy_offsets)(start, end, size)
    greedy_peak = int((greedy + size).max())
    lower = max_live(start, end, size)
    floor = max(floor, lower)
    near = floor + math.floor(NEAR_OPTIMAL * floor)  # peaks up to here end the search
    if search.solver == "greedy" or greedy_peak <= near:
        return _Placed(greedy, greedy_peak, lower)
    solver = search.solver
    while True:
        if time.perf_counter() >= search.deadline:
            search.notes.append(
                f"{solver}: no time left; kept the greedy placement ({greedy_peak / lower:.3f} x bound)"
            )
            return _Placed(greedy, greedy_peak, lower)
        try:
            result = _exact(search, solver, start, end, size, greedy, floor)
            break
        except SolverUnavailable as error:
            fallback = _FALLBACK[solver]
            search.notes.append(f"{solver} is unavailable: {error}; solving with {fallback}")
            search.solver = solver = fallback
            if solver == "greedy":
                return _Placed(greedy, greedy_peak, lower)
    found = result.offsets
    # result.bound bounds max(floor, optimum): above the floor it bounds the optimum itself.
    bound = max(lower, result.bound) if result.bound > floor else lower
    if found is None or find_conflict(start, end, size, found) is not None:
        what = "found no placement" if found is None else "returned an invalid placement"
        search.notes.append(f"{solver} {what} ({result.status}); kept the greedy placement")
        return _Placed(greedy, greedy_peak, bound)
    peak = int((found + size).max())
    if not result.proven and peak > near:
        search.notes.append(
            f"{solver} stopped at its time limit before proving the placement optimal ({result.status}, "
            f"peak {peak / lower:.3f} x lower bound); using the best placement found"
        )
    return _Placed(found, peak, bound)


def _solve_group(search: _Search, start, end, size, floor: int, depth: int = 0) -> _Placed:
    """Place a group: stack the boxes that meet all others, split the rest by time, solve each part."""
    n = len(size)
    offsets = np.zeros(n, dtype=np.int64)
    rest = np.arange(n)
    base = 0
    while rest.size:
        universal = _universal(start[rest], end[rest])
        if not universal.any():
            break
        for i in rest[universal]:
            offsets[i] = base
            base += int(size[i])
        rest = rest[~universal]
    if rest.size == 0:
        return _Placed(offsets, base, base)
    groups = _components(start[rest], end[rest])
    if (len(groups) == 1 and base == 0) or depth >= _MAX_DEPTH:
        return _solve_leaf(search, start, end, size, floor)
    parts = [rest[g] for g in groups]
    lowers = [max_live(start[p], end[p], size[p]) for p in parts]
    needed = max(floor - base, max(lowers))
    peak = bound = 0
    for k in np.argsort(lowers)[::-1]:
        part = parts[k]
        placed = _solve_group(search, start[part], end[part], size[part], needed, depth + 1)
        offsets[part] = base + placed.offsets
        peak, bound = max(peak, placed.peak), max(bound, placed.bound)
        needed = max(needed, placed.bound)
    return _Placed(offsets, base + peak, base + bound)


def solve_dsa(
    trace: Trace,
    solver: str = "cpsat",
    time_limit: float = 10.0,
    alignment: int = 512,
    workers: int = 1,
    seed: int = 0,
) -> DSASolution:
    """Byte offsets for every tensor of ``trace`` in one arena, as low a peak as ``solver`` finds.

    Args:
        trace: the tensors and their lifetimes.
        solver: ``"cpsat"`` (OR-Tools CP-SAT, exact), ``"greedy"`` (best fit, largest first),
            ``"mip"`` (MEMO's big-M model in HiGHS, for comparison) or ``"gurobi"`` (the same model in
            Gurobi, when installed and licensed; otherwise CP-SAT).
        time_limit: seconds for the whole solve; the best valid placement found by then is returned.
        alignment: bytes each size is rounded up to (and each offset a multiple of); 512 matches
            PyTorch's CUDA allocator and keeps every view aligned for any dtype.
        workers: solver threads (CP-SAT, Gurobi); one was fastest on a 2-core machine and is reproducible.
        seed: solver random seed, for reproducible plans.

    Returns:
        A :class:`DSASolution`; ``optimal`` is ``True`` only when the peak is proven minimal.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    if not (isinstance(alignment, int) and alignment >= 1):
        raise ValueError(f"alignment must be an int >= 1 bytes, got {alignment!r}")
    if not time_limit > 0:
        raise ValueError(f"time_limit must be a number of seconds > 0, got {time_limit!r}")
    began = time.perf_counter()
    search = _Search(solver, began + time_limit, workers, seed)
    ids = [life.tensor_id for life in trace.lifetimes]
    start = np.array([life.start for life in trace.lifetimes], dtype=np.int64)
    end = np.array([life.end for life in trace.lifetimes], dtype=np.int64)
    units = np.array([-(-life.size // alignment) for life in trace.lifetimes], dtype=np.int64)
    if not ids:
        return DSASolution({}, 0, 0, True, solver, time.perf_counter() - began, alignment, "empty trace")
    lower = max_live(start, end, units) * alignment
    placed = _solve_group(search, start, end, units, 0)
    offsets = {tensor_id: int(offset) * alignment for tensor_id, offset in zip(ids, placed.offsets)}
    try:
        peak = check_placement(trace, offsets, alignment)
    except ValueError as error:
        search.notes.append(f"the combined placement failed its check ({error}); using the greedy placement")
        greedy = best_fit_offsets(start, end, units)
        placed = _Placed(greedy, int((greedy + units).max()), lower // alignment)
        offsets = {tensor_id: int(offset) * alignment for tensor_id, offset in zip(ids, greedy)}
        peak = check_placement(trace, offsets, alignment)
    optimal = peak in (lower, placed.bound * alignment)
    status = "optimal: peak equals the lower bound" if peak == lower else "optimal: proven by the solver"
    if not optimal:
        status = f"feasible: peak {peak / lower:.6f} x lower bound, optimum >= {placed.bound * alignment} bytes"
    if search.notes:
        status += "; " + "; ".join(search.notes)
        warnings.warn(f"memory planner: {'; '.join(search.notes)}", PlannerWarning, stacklevel=2)
    return DSASolution(offsets, peak, lower, optimal, search.solver, time.perf_counter() - began, alignment, status)
