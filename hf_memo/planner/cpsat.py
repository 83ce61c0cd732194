"""Exact DSA with OR-Tools CP-SAT: fixed time intervals, offset variables, one ``NoOverlap2D``.

Every tensor is a rectangle: its time interval is fixed (``[start, end)``), its memory interval
``[x, x + size)`` has a variable start ``x``. ``NoOverlap2D`` forbids two rectangles to intersect, and
the objective is the smallest ``peak >= x + size``. ``peak`` starts at ``floor`` (the lower bound, or a
height the caller does not need to go below), so the search stops the moment a placement reaches it:
the bound is then proven. The greedy placement's peak is the upper bound of ``peak``.

The greedy placement is not passed as a solution hint: on 30 irregular 100-tensor traces (2 cores)
the hint made the search 1.8x slower in total, and the caller keeps the greedy placement anyway when
CP-SAT finds nothing better in time. One worker is the default: on that machine two workers took
longer (see ``benchmarks/planner_dsa.py``), and one worker makes plans reproducible.
"""

from __future__ import annotations

import numpy as np

from hf_memo.planner.exact import ExactResult, SolverUnavailable


def cpsat_offsets(
    start: np.ndarray,
    end: np.ndarray,
    size: np.ndarray,
    hint: np.ndarray,
    floor: int,
    time_limit: float,
    workers: int = 1,
    seed: int = 0,
) -> ExactResult:
    """Minimise the peak of boxes ``[start, end) x size`` (arrays of shape ``(n,)``), never below ``floor``.

    ``hint`` is a valid placement (shape ``(n,)``) whose peak bounds the search from above.
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise SolverUnavailable(f"OR-Tools is not installed ({error})") from None
    upper = int((hint + size).max())
    floor = min(int(floor), upper)
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
    model.minimize(peak)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(float(time_limit), 0.01)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    status = solver.solve(model)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return ExactResult(None, floor, False, name)
    found = np.array([solver.value(x) for x in offsets], dtype=np.int64)
    return ExactResult(found, int(solver.best_objective_bound), status == cp_model.OPTIMAL, name)
