"""Exact DSA with OR-Tools CP-SAT: fixed time intervals, offset variables, one ``NoOverlap2D``.

Every tensor is a rectangle: its time interval is fixed (``[start, end)``), its memory interval
``[x, x + size)`` has a variable start ``x``. ``NoOverlap2D`` forbids two rectangles to intersect, and
the objective is the smallest ``peak >= x + size``. The greedy placement's peak is the upper bound of
``peak``; ``floor`` (the lower bound, or a height the caller does not need to go below) its lower bound.

Layer traces nearly always have a placement at the floor, and asking for one directly — every offset
confined to ``[0, floor - size]``, no objective — is far easier for CP-SAT than minimising the peak
from the greedy's height down: on the backward pass of a profiled Llama-3-8B layer with mini-sequence
MLP (174 tensors) it took 0.05 s against 12 s. So a solve first tries the floor, with at most
:data:`FLOOR_SHARE` of the time; a placement found there is optimal, a proof that there is none raises
the floor by one, and only then does the minimisation run, with the time left.

The greedy placement is not passed as a solution hint: on 30 irregular 100-tensor traces (2 cores)
the hint made the search 1.8x slower in total, and the caller keeps the greedy placement anyway when
CP-SAT finds nothing better in time. One worker is the default: on that machine two workers took
longer (see ``benchmarks/planner_dsa.py``), and one worker makes plans reproducible.
"""

from __future__ import annotations

import math
import time

import numpy as np

from hf_memo.planner.exact import ExactResult, SolverUnavailable

FLOOR_SHARE = 0.25  # most of the time limit the attempt at the floor may take


def _solve(
    start, end, size, floor: int, upper: int, time_limit: float, workers: int, seed: int, gap: float = 0.0
) -> ExactResult:
    """Minimise the peak over ``[floor, upper]`` (with ``floor == upper``: find a placement at that height), stopping
    once the peak is within ``gap`` (a share of the peak) of the proven bound."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    peak = model.new_int_var(floor, upper, "peak")
    times, spaces, offsets = [], [], []
    for i in range(len(size)):
        s, length = int(size[i]), int(end[i] - start[i])
        x = model.new_int_var(0, upper - s, f"x{i}")
        model.add(x + s <= peak)
        offsets.append(x)
        times.append(model.new_fixed_size_interval_var(int(start[i]), length, f"t{i}"))
        spaces.append(model.new_fixed_size_interval_var(x, s, f"m{i}"))
    model.add_no_overlap_2d(times, spaces)
    if floor < upper:
        model.minimize(peak)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(float(time_limit), 0.01)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    solver.parameters.relative_gap_limit = gap
    status = solver.solve(model)
    name = solver.status_name(status)
    if status == cp_model.INFEASIBLE:
        return ExactResult(None, upper + 1, True, name)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return ExactResult(None, floor, False, name)
    found = np.array([solver.value(x) for x in offsets], dtype=np.int64)
    bound = floor if floor == upper else math.ceil(solver.best_objective_bound - 1e-9)
    # OPTIMAL also reports a stop within the gap limit: proven only where the bound reaches the peak.
    proven = status == cp_model.OPTIMAL and bound >= int((found + size).max())
    return ExactResult(found, bound, proven, name)


def cpsat_offsets(
    start: np.ndarray,
    end: np.ndarray,
    size: np.ndarray,
    hint: np.ndarray,
    floor: int,
    time_limit: float,
    workers: int = 1,
    seed: int = 0,
    gap: float = 0.0,
) -> ExactResult:
    """Minimise the peak of boxes ``[start, end) x size`` (arrays of shape ``(n,)``), never below ``floor``.

    ``hint`` is a valid placement (shape ``(n,)``) whose peak bounds the search from above. The minimisation
    stops once its peak is within ``gap`` (a share of the peak, e.g. ``1e-4``) of its proven bound.
    """
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError as error:
        raise SolverUnavailable(f"OR-Tools is not installed ({error})") from None
    began = time.perf_counter()
    upper = int((hint + size).max())
    floor = min(int(floor), upper)
    if floor < upper:
        at_floor = _solve(start, end, size, floor, floor, FLOOR_SHARE * time_limit, workers, seed)
        if at_floor.offsets is not None:
            return ExactResult(at_floor.offsets, floor, True, f"{at_floor.status} at the floor")
        if at_floor.proven:  # no placement at the floor: the optimum is higher
            floor += 1
    if floor >= upper:
        return ExactResult(hint.copy(), upper, True, "INFEASIBLE below the greedy's peak")
    remaining = time_limit - (time.perf_counter() - began)
    return _solve(start, end, size, floor, upper, remaining, workers, seed, gap)
