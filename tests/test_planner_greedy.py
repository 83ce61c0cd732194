import numpy as np
from hypothesis import given, settings

from hf_memo.planner import dsa
from hf_memo.planner.dsa import solve_dsa
from hf_memo.planner.greedy import best_fit_offsets, best_greedy_offsets
from hf_memo.planner.lifetimes import Trace
from hf_memo.planner.solution import check_placement
from tests.planner_traces import brute_force_optimum, traces

# Tensors 0 [0, 2) x 3, 1 [1, 4) x 2, 2 [3, 6) x 2, 3 [5, 7) x 3: at most 5 live at once. Largest first puts 0 and
# 3 at the bottom, 1 on 0 and then 2 can only go on top of both (peak 7). Equal size x lifetime ties go by start:
# 0, 1, then 2 under 1 and 3 on 2, peak 5.
LARGEST_FIRST_MISSES = [("malloc", 0, 3), ("malloc", 1, 2), ("free", 0, 3), ("malloc", 2, 2), ("free", 1, 2)]
LARGEST_FIRST_MISSES += [("malloc", 3, 3), ("free", 2, 2), ("free", 3, 3)]


def _boxes(trace):
    lives = trace.lifetimes
    return tuple(np.array([getattr(life, k) for life in lives], dtype=np.int64) for k in ("start", "end", "size"))


def _peak(offsets, size):
    return int((offsets + size).max())


def test_other_orders_reach_the_bound_where_largest_first_does_not():
    trace = Trace.from_events(LARGEST_FIRST_MISSES)
    start, end, size = _boxes(trace)
    assert trace.lower_bound() == brute_force_optimum(trace) == 5
    assert _peak(best_fit_offsets(start, end, size), size) == 7
    assert _peak(best_greedy_offsets(start, end, size), size) == 5


def test_the_greedy_solver_stays_largest_first_and_the_exact_solver_is_skipped_at_the_bound(monkeypatch):
    trace = Trace.from_events(LARGEST_FIRST_MISSES)
    assert solve_dsa(trace, "greedy", alignment=1).peak == 7

    def no_exact_solve(*args, **kwargs):
        raise AssertionError("the greedy start is already optimal")

    monkeypatch.setattr(dsa, "cpsat_offsets", no_exact_solve)
    solution = solve_dsa(trace, "cpsat", alignment=1)
    assert (solution.peak, solution.optimal) == (5, True)


@settings(max_examples=80, deadline=None)
@given(traces())
def test_the_best_of_several_orders_is_valid_and_never_above_largest_first(trace):
    start, end, size = _boxes(trace)
    offsets = best_greedy_offsets(start, end, size)
    peak = check_placement(trace, dict(zip((life.tensor_id for life in trace.lifetimes), offsets.tolist())))
    assert trace.lower_bound() <= peak == _peak(offsets, size) <= _peak(best_fit_offsets(start, end, size), size)
