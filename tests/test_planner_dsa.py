import sys
import types
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from hf_memo.planner import dsa
from hf_memo.planner.dsa import PlannerWarning, solve_dsa
from hf_memo.planner.exact import ExactResult
from hf_memo.planner.lifetimes import Lifetime, Trace
from hf_memo.planner.solution import check_placement, find_conflict
from tests.planner_traces import brute_force_optimum, traces

# Greedy (largest first, best fit) needs 6 units here, the optimum is 5 = the lower bound: tensor 0 at 0,
# tensor 1 at 1, tensor 3 at 0 and tensor 2 at 3.
GREEDY_IS_NOT_OPTIMAL = [
    ("malloc", 0, 1),
    ("malloc", 1, 3),
    ("free", 1, 3),
    ("malloc", 2, 2),
    ("free", 0, 1),
    ("malloc", 3, 3),
    ("free", 3, 3),
    ("free", 2, 2),
]


def quiet_solve(trace, solver, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlannerWarning)
        return solve_dsa(trace, solver, **kwargs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_random_traces_get_valid_plans_and_cpsat_is_never_worse_than_greedy(trace):
    greedy = solve_dsa(trace, "greedy", alignment=1)
    cpsat = quiet_solve(trace, "cpsat", alignment=1, time_limit=5)
    for solution in (greedy, cpsat):
        assert check_placement(trace, solution.offsets) == solution.peak
        assert solution.peak >= solution.lower_bound == trace.lower_bound()
    assert greedy.optimal == (greedy.peak == greedy.lower_bound)
    assert cpsat.peak <= greedy.peak


@settings(max_examples=40, deadline=None)
@given(traces(max_tensors=6, sizes=(1, 2, 3)))
def test_cpsat_reaches_the_optimum_found_by_exhaustion(trace):
    solution = quiet_solve(trace, "cpsat", alignment=1, time_limit=5)
    assert solution.peak == brute_force_optimum(trace)
    assert solution.optimal


def test_hand_made_trace_where_greedy_misses_the_optimum():
    trace = Trace.from_events(GREEDY_IS_NOT_OPTIMAL)
    assert brute_force_optimum(trace) == 5 == trace.lower_bound()
    greedy = solve_dsa(trace, "greedy", alignment=1)
    assert (greedy.peak, greedy.optimal) == (6, False)
    for solver in ("cpsat", "mip"):
        solution = solve_dsa(trace, solver, alignment=1, time_limit=10)
        assert (solution.peak, solution.optimal, solution.solver) == (5, True, solver)
        check_placement(trace, solution.offsets)


def test_a_greedy_placement_within_the_near_optimal_share_of_the_bound_ends_the_search(monkeypatch):
    def unused(*args):
        raise AssertionError("the exact solver ran for a placement already near the bound")

    monkeypatch.setattr(dsa, "cpsat_offsets", unused)
    monkeypatch.setattr(dsa, "NEAR_OPTIMAL", 0.2)  # 6 is within 20% of 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        solution = solve_dsa(Trace.from_events(GREEDY_IS_NOT_OPTIMAL), "cpsat", alignment=1)
    assert (solution.peak, solution.lower_bound, solution.optimal) == (6, 5, False)
    assert solution.status.startswith("feasible: peak 1.200000 x lower bound")


def test_cpsat_stops_within_its_gap_and_only_claims_what_it_proved():
    lives = Trace.from_events(GREEDY_IS_NOT_OPTIMAL).lifetimes
    start, end, size = (
        np.array([getattr(life, k) for life in lives], dtype=np.int64) for k in ("start", "end", "size")
    )
    greedy = np.array([3, 0, 0, 3])  # peak 6, a valid placement
    result = dsa.cpsat_offsets(start, end, size, greedy, floor=4, time_limit=10, gap=0.5)
    peak = int((result.offsets + size).max())
    assert find_conflict(start, end, size, result.offsets) is None and result.bound == 5
    assert peak in (5, 6) and result.proven == (peak == 5)  # OPTIMAL within the gap is not a proof of 6


def test_sizes_are_rounded_up_to_the_alignment_and_offsets_aligned():
    trace = Trace.from_events([("malloc", 1, 100), ("malloc", 2, 600), ("malloc", 3, 1)])
    solution = solve_dsa(trace, "cpsat")
    assert solution.alignment == 512
    assert (solution.peak, solution.lower_bound) == (512 + 1024 + 512, 2048)
    assert all(offset % 512 == 0 for offset in solution.offsets.values())
    assert solve_dsa(trace, "cpsat", alignment=1).peak == 701


def test_reductions_keep_whole_step_tensors_at_the_bottom_and_solve_phases_apart():
    # Two parameters alive throughout, then two independent phases; phase B is the bigger one.
    events = [("malloc", 100, 4), ("malloc", 101, 2)]
    events += [("malloc", 1, 1), ("malloc", 2, 3), ("free", 1, 1), ("malloc", 3, 1), ("free", 2, 3), ("free", 3, 1)]
    events += [
        ("malloc", 4, 1),
        ("malloc", 5, 3),
        ("free", 5, 3),
        ("malloc", 6, 2),
        ("free", 4, 1),
        ("malloc", 7, 3),
        ("free", 7, 3),
        ("free", 6, 2),
    ]
    trace = Trace.from_events(events)
    solution = solve_dsa(trace, "cpsat", alignment=1)
    assert solution.peak == solution.lower_bound == 6 + 5 and solution.optimal
    assert sorted([solution.offsets[100], solution.offsets[101]]) in ([0, 4], [0, 2])
    check_placement(trace, solution.offsets)


def test_empty_trace_and_bad_arguments():
    empty = solve_dsa(Trace([], 0))
    assert (empty.peak, empty.lower_bound, empty.optimal, empty.offsets) == (0, 0, True, {})
    trace = Trace.from_events(GREEDY_IS_NOT_OPTIMAL)
    with pytest.raises(ValueError, match="solver must be one of cpsat, greedy, mip, gurobi, got 'ilp'"):
        solve_dsa(trace, "ilp")
    with pytest.raises(ValueError, match="alignment must be an int >= 1 bytes, got 0"):
        solve_dsa(trace, alignment=0)
    with pytest.raises(ValueError, match="time_limit must be a number of seconds > 0, got 0"):
        solve_dsa(trace, time_limit=0)


def test_missing_gurobi_falls_back_to_cpsat_with_a_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "gurobipy", None)  # import gurobipy -> ImportError
    trace = Trace.from_events(GREEDY_IS_NOT_OPTIMAL)
    with pytest.warns(PlannerWarning, match="gurobi is unavailable: gurobipy is not installed.*solving with cpsat"):
        solution = solve_dsa(trace, "gurobi", alignment=1)
    assert (solution.solver, solution.peak, solution.optimal) == ("cpsat", 5, True)
    assert "gurobi is unavailable" in solution.status


def test_gurobi_license_refusal_falls_back_with_a_warning(monkeypatch):
    class GurobiError(Exception):
        pass

    def refuse(*args, **kwargs):
        raise GurobiError("Model too large for size-limited license; visit https://gurobi.com/unrestricted")

    fake = types.SimpleNamespace(GurobiError=GurobiError, Env=refuse, Model=refuse, GRB=None)
    monkeypatch.setitem(sys.modules, "gurobipy", fake)
    trace = Trace.from_events(GREEDY_IS_NOT_OPTIMAL)
    with pytest.warns(PlannerWarning, match="Gurobi refused the model \\(Model too large for size-limited license"):
        solution = solve_dsa(trace, "gurobi", alignment=1)
    assert (solution.solver, solution.peak) == ("cpsat", 5)


def test_missing_ortools_falls_back_to_greedy(monkeypatch):
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    monkeypatch.setitem(sys.modules, "ortools.sat.python.cp_model", None)
    trace = Trace.from_events(GREEDY_IS_NOT_OPTIMAL)
    with pytest.warns(PlannerWarning, match="cpsat is unavailable: OR-Tools is not installed.*solving with greedy"):
        solution = solve_dsa(trace, "cpsat", alignment=1)
    assert (solution.solver, solution.peak, solution.optimal) == ("greedy", 6, False)


def test_timeout_without_a_solution_keeps_the_greedy_plan(monkeypatch):
    monkeypatch.setattr(dsa, "cpsat_offsets", lambda *a, **k: ExactResult(None, 5, False, "UNKNOWN"))
    trace = Trace.from_events(GREEDY_IS_NOT_OPTIMAL)
    with pytest.warns(PlannerWarning, match=r"cpsat found no placement \(UNKNOWN\); kept the greedy placement"):
        solution = solve_dsa(trace, "cpsat", alignment=1)
    assert (solution.peak, solution.optimal) == (6, False)


def test_invalid_solver_answer_is_caught_and_replaced(monkeypatch):
    overlapping = ExactResult(np.zeros(4, dtype=np.int64), 5, True, "OPTIMAL")
    monkeypatch.setattr(dsa, "cpsat_offsets", lambda *a, **k: overlapping)
    trace = Trace.from_events(GREEDY_IS_NOT_OPTIMAL)
    with pytest.warns(PlannerWarning, match="cpsat returned an invalid placement"):
        solution = solve_dsa(trace, "cpsat", alignment=1)
    assert solution.peak == 6
    check_placement(trace, solution.offsets)


def test_a_combined_placement_that_fails_its_check_is_replaced_by_the_greedy(monkeypatch):
    broken = dsa._Placed(np.zeros(4, dtype=np.int64), 3, 3)
    monkeypatch.setattr(dsa, "_solve_group", lambda *a, **k: broken)
    trace = Trace.from_events(GREEDY_IS_NOT_OPTIMAL)
    with pytest.warns(PlannerWarning, match="the combined placement failed its check .*using the greedy placement"):
        solution = solve_dsa(trace, "cpsat", alignment=1)
    assert (solution.peak, solution.optimal) == (6, False)
    check_placement(trace, solution.offsets)


def _hard_trace(seed: int, tensors: int = 250) -> Trace:
    rng = np.random.default_rng(seed)
    events, live = [], []
    for tensor_id in range(tensors):
        while live and rng.random() < 0.45:
            events.append(("free", *live.pop(int(rng.integers(len(live))))))
        size = int(rng.choice([1, 2, 3, 5, 8, 13]) * rng.integers(1, 9))
        events.append(("malloc", tensor_id, size))
        live.append((tensor_id, size))
    return Trace.from_events(events)


def test_a_real_time_limit_returns_the_best_valid_plan_and_warns_only_when_unproven():
    trace = _hard_trace(2)
    greedy = solve_dsa(trace, "greedy", alignment=1)
    assert not greedy.optimal  # otherwise the time limit would not be exercised
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        solution = solve_dsa(trace, "cpsat", alignment=1, time_limit=0.05)
    check_placement(trace, solution.offsets)
    assert solution.peak <= greedy.peak
    planner_warnings = [w for w in caught if issubclass(w.category, PlannerWarning)]
    assert bool(planner_warnings) == (not solution.optimal)


def test_mip_on_a_small_trace_matches_cpsat():
    trace = Trace([Lifetime(i, 1 + i % 3, i, i + 4) for i in range(8)], 12)
    mip = solve_dsa(trace, "mip", alignment=1, time_limit=20)
    cpsat = solve_dsa(trace, "cpsat", alignment=1)
    assert mip.peak == cpsat.peak == brute_force_optimum(trace)
    assert mip.optimal and mip.solver == "mip"


@settings(max_examples=30, deadline=None)
@given(traces(max_tensors=6, sizes=(1, 2, 3)))
def test_sizes_with_a_common_factor_are_solved_in_units_of_it_without_losing_the_optimum(trace):
    unit = 3 * 4096
    scaled = Trace(
        [Lifetime(life.tensor_id, life.size * unit, life.start, life.end) for life in trace.lifetimes], trace.length
    )
    solution = quiet_solve(scaled, "cpsat", alignment=1, time_limit=5)
    assert solution.peak == unit * brute_force_optimum(trace) and solution.optimal
    assert check_placement(scaled, solution.offsets) == solution.peak
