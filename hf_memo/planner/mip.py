"""MEMO's big-M mixed-integer formulation of DSA, for HiGHS (``scipy.optimize.milp``) and Gurobi.

Variables: an offset ``x_i`` per tensor, the ``peak`` and one binary ``z_ij`` per pair of tensors whose
lifetimes intersect. With ``M`` the greedy peak::

    minimise peak
    x_i + size_i <= peak
    x_i + size_i <= x_j + M z_ij            (z_ij = 0: i below j)
    x_j + size_j <= x_i + M (1 - z_ij)      (z_ij = 1: j below i)

Kept for comparison with CP-SAT: the number of binaries grows with the square of the tensors alive
together, and the LP relaxation of big-M constraints is weak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scipy.sparse import coo_matrix

from hf_memo.planner.exact import ExactResult, SolverUnavailable


def overlapping_pairs(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Pairs ``(i, j)`` of boxes whose time spans intersect, shape ``(pairs, 2)``."""
    order = np.argsort(start, kind="stable")
    sorted_start = start[order]
    pairs = []
    for k, i in enumerate(order):
        stop = int(np.searchsorted(sorted_start, end[i], side="left"))
        for j in order[k + 1 : stop]:
            pairs.append((i, j))
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def _big_m_rows(size: np.ndarray, pairs: np.ndarray, upper: int) -> tuple[coo_matrix, np.ndarray]:
    """Constraint matrix ``A`` and right-hand side ``b`` of ``A @ [x, peak, z] <= b``."""
    n, m = len(size), len(pairs)
    peak = n
    rows, cols, vals, rhs = [], [], [], []
    for i in range(n):  # x_i - peak <= -size_i
        rows += [i, i]
        cols += [i, peak]
        vals += [1, -1]
        rhs.append(-size[i])
    for p, (i, j) in enumerate(pairs):
        r, z = n + 2 * p, n + 1 + p
        rows += [r, r, r]  # x_i - x_j - M z <= -size_i
        cols += [i, j, z]
        vals += [1, -1, -upper]
        rhs.append(-size[i])
        rows += [r + 1, r + 1, r + 1]  # x_j - x_i + M z <= M - size_j
        cols += [j, i, z]
        vals += [1, -1, upper]
        rhs.append(upper - size[j])
    from scipy.sparse import coo_matrix  # SciPy on first use: importing the planner does not load it

    matrix = coo_matrix((vals, (rows, cols)), shape=(n + 2 * m, n + 1 + m))
    return matrix, np.array(rhs, dtype=float)


def milp_offsets(
    start: np.ndarray, end: np.ndarray, size: np.ndarray, hint: np.ndarray, floor: int, time_limit: float
) -> ExactResult:
    """The big-M model solved by HiGHS through ``scipy.optimize.milp`` (``hint`` only sets ``M``)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    upper = int((hint + size).max())
    floor = min(int(floor), upper)
    n = len(size)
    pairs = overlapping_pairs(start, end)
    matrix, rhs = _big_m_rows(size, pairs, upper)
    objective = np.zeros(n + 1 + len(pairs))
    objective[n] = 1.0
    lower = np.concatenate((np.zeros(n), [floor], np.zeros(len(pairs))))
    higher = np.concatenate((upper - size, [upper], np.ones(len(pairs))))
    result = milp(
        objective,
        constraints=LinearConstraint(matrix.tocsr(), -np.inf, rhs),
        integrality=np.ones_like(objective),
        bounds=Bounds(lower, higher),
        options={"time_limit": max(float(time_limit), 0.01), "disp": False},
    )
    bound = getattr(result, "mip_dual_bound", None)
    bound = floor if bound is None or not np.isfinite(bound) else max(floor, int(np.ceil(bound - 1e-6)))
    if result.x is None:
        return ExactResult(None, bound, False, result.message)
    found = np.round(result.x[:n]).astype(np.int64)
    return ExactResult(found, bound, result.status == 0, result.message)


def gurobi_offsets(
    start: np.ndarray,
    end: np.ndarray,
    size: np.ndarray,
    hint: np.ndarray,
    floor: int,
    time_limit: float,
    workers: int = 1,
    seed: int = 0,
) -> ExactResult:
    """The big-M model solved by Gurobi, warm-started from ``hint``.

    Raises :class:`SolverUnavailable` when ``gurobipy`` does not import or its license refuses the
    model (the pip license is limited to 2000 variables and constraints).
    """
    try:
        import gurobipy as gp
    except ImportError as error:
        raise SolverUnavailable(f"gurobipy is not installed ({error})") from None
    upper = int((hint + size).max())
    floor = min(int(floor), upper)
    pairs = overlapping_pairs(start, end)
    try:
        with gp.Env(params={"OutputFlag": 0}) as env, gp.Model(env=env) as model:
            x = [model.addVar(lb=0, ub=upper - int(s), vtype=gp.GRB.INTEGER) for s in size]
            peak = model.addVar(lb=floor, ub=upper, vtype=gp.GRB.INTEGER)
            for i, s in enumerate(size):
                model.addConstr(x[i] + int(s) <= peak)
                x[i].Start = int(hint[i])
            for i, j in pairs:
                z = model.addVar(vtype=gp.GRB.BINARY)
                model.addConstr(x[i] + int(size[i]) <= x[j] + upper * z)
                model.addConstr(x[j] + int(size[j]) <= x[i] + upper * (1 - z))
            model.setObjective(peak, gp.GRB.MINIMIZE)
            model.Params.TimeLimit = max(float(time_limit), 0.01)
            model.Params.Threads = workers
            model.Params.Seed = seed
            model.optimize()
            bound = max(floor, int(np.ceil(model.ObjBound - 1e-6)))
            proven = model.Status == gp.GRB.OPTIMAL
            if model.SolCount == 0:
                return ExactResult(None, bound, False, f"gurobi status {model.Status}")
            found = np.array([round(v.X) for v in x], dtype=np.int64)
            return ExactResult(found, bound, proven, f"gurobi status {model.Status}")
    except gp.GurobiError as error:
        raise SolverUnavailable(f"Gurobi refused the model ({error})") from None
