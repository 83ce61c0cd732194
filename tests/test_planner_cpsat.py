import numpy as np

from hf_memo.planner.cpsat import cpsat_offsets
from hf_memo.planner.greedy import best_fit_offsets
from hf_memo.planner.lifetimes import Trace
from hf_memo.planner.solution import find_conflict
from tests.test_planner_dsa import GREEDY_IS_NOT_OPTIMAL


def _boxes():
    lives = Trace.from_events(GREEDY_IS_NOT_OPTIMAL).lifetimes
    return tuple(np.array([getattr(life, k) for life in lives], dtype=np.int64) for k in ("start", "end", "size"))


def test_a_placement_at_the_floor_is_found_first_and_is_optimal():
    start, end, size = _boxes()
    greedy = best_fit_offsets(start, end, size)
    assert int((greedy + size).max()) == 6  # the lower bound, and optimum, is 5
    result = cpsat_offsets(start, end, size, greedy, floor=5, time_limit=10)
    assert result.status.endswith("at the floor") and result.proven and result.bound == 5
    assert find_conflict(start, end, size, result.offsets) is None
    assert int((result.offsets + size).max()) == 5


def test_a_floor_with_no_placement_is_raised_before_minimising():
    start, end, size = _boxes()
    greedy = best_fit_offsets(start, end, size)
    result = cpsat_offsets(start, end, size, greedy, floor=4, time_limit=10)  # 5 bytes are live at once
    assert not result.status.endswith("at the floor")
    assert result.proven and result.bound == 5 and int((result.offsets + size).max()) == 5
    assert find_conflict(start, end, size, result.offsets) is None


def test_when_nothing_fits_below_the_hint_the_hint_is_proven_optimal():
    start, end, size = _boxes()
    optimal = np.array([0, 1, 3, 0], dtype=np.int64)  # peak 5
    assert find_conflict(start, end, size, optimal) is None
    result = cpsat_offsets(start, end, size, optimal, floor=4, time_limit=10)
    assert result.proven and result.bound == 5 and result.offsets.tolist() == optimal.tolist()
