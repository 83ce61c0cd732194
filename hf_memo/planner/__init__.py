"""Offline memory planning: tensor lifetimes, DSA solvers (CP-SAT, greedy, MIP), the bi-level plan, and a
replay of PyTorch's caching allocator to compare against."""

from hf_memo.planner.bilevel import plan_fingerprint, plan_memory
from hf_memo.planner.caching_allocator import AllocatorReplay, replay, replay_with_arena
from hf_memo.planner.dsa import SOLVERS, PlannerWarning, solve_dsa
from hf_memo.planner.lifetimes import Lifetime, Trace
from hf_memo.planner.plan import MemoryPlan
from hf_memo.planner.solution import DSASolution, check_placement

__all__ = [
    "SOLVERS",
    "AllocatorReplay",
    "DSASolution",
    "Lifetime",
    "MemoryPlan",
    "PlannerWarning",
    "Trace",
    "check_placement",
    "plan_fingerprint",
    "plan_memory",
    "replay",
    "replay_with_arena",
    "solve_dsa",
]
