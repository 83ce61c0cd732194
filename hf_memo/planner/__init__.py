"""Offline memory planning: tensor lifetimes, DSA solvers (CP-SAT, greedy, MIP) and the bi-level plan."""

from hf_memo.planner.dsa import SOLVERS, PlannerWarning, solve_dsa
from hf_memo.planner.lifetimes import Lifetime, Trace
from hf_memo.planner.solution import DSASolution, check_placement

__all__ = ["SOLVERS", "DSASolution", "Lifetime", "PlannerWarning", "Trace", "check_placement", "solve_dsa"]
