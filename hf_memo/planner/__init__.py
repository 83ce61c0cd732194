"""Offline memory planning: tensor lifetimes, DSA solvers (CP-SAT, greedy, MIP), the bi-level plan, and a
replay of PyTorch's caching allocator to compare against.

The public names are imported on first use (PEP 562): the policy solver alone needs none of the DSA solvers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_memo.lazy_names import lazy_names

if TYPE_CHECKING:
    from hf_memo.planner.bilevel import plan_fingerprint, plan_memory
    from hf_memo.planner.caching_allocator import AllocatorReplay, replay, replay_with_arena
    from hf_memo.planner.dsa import SOLVERS, PlannerWarning, solve_dsa
    from hf_memo.planner.lifetimes import Lifetime, Trace
    from hf_memo.planner.plan import MemoryPlan
    from hf_memo.planner.solution import DSASolution, check_placement

_PUBLIC = {  # name -> the module it comes from
    "plan_fingerprint": "hf_memo.planner.bilevel",
    "plan_memory": "hf_memo.planner.bilevel",
    "AllocatorReplay": "hf_memo.planner.caching_allocator",
    "replay": "hf_memo.planner.caching_allocator",
    "replay_with_arena": "hf_memo.planner.caching_allocator",
    "SOLVERS": "hf_memo.planner.dsa",
    "PlannerWarning": "hf_memo.planner.dsa",
    "solve_dsa": "hf_memo.planner.dsa",
    "Lifetime": "hf_memo.planner.lifetimes",
    "Trace": "hf_memo.planner.lifetimes",
    "MemoryPlan": "hf_memo.planner.plan",
    "DSASolution": "hf_memo.planner.solution",
    "check_placement": "hf_memo.planner.solution",
}

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


__getattr__ = lazy_names(__name__, _PUBLIC)
