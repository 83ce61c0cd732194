"""The arena: one device buffer from which hf_memo's own buffers are served at their planned offsets.

The buffers hf_memo allocates itself (prefetch buffers, chunk intermediates, ...)
have stable names (``"layer 3 prefetch 0"``). A :class:`~hf_memo.planner.plan.MemoryPlan` gives each
name an offset in an arena of ``plan.arena_size`` bytes such that buffers alive at the same time
never overlap. The arena allocates that buffer once and hands out views::

    arena = Arena(plan, device="cuda")
    x = arena.take("layer 3 prefetch 0", (S, H), torch.bfloat16)   # a (S, H) view at its planned offset
    ...                                                          # use x
    arena.release("layer 3 prefetch 0")                          # x's memory may now serve another name

A name stays taken until it is released. The arena never hands out memory that a taken buffer
occupies: a request that would overlap one (the run's lifetimes differ from the plan's), that is
larger than its planned slot (other shapes than planned), that names a buffer the plan does not
know, or that comes with no plan (``planner="off"``, or a plan made for another trace) is served by
a normal allocation from PyTorch's caching allocator instead, with a warning. Results are never
wrong; only the memory saving is lost. A plan whose arena would make the step reserve more than the caching
allocator alone (``plan.arena_used`` false; the planner said so when it made the plan) serves every request by a
normal allocation, without further warnings.

Buffers handed out by a normal allocation are tagged with their name
(:func:`hf_memo.profiler.placement.mark_owned`), so profiling a run without a plan records the
names a plan needs. Synchronising side streams that use a buffer before it is released is the
caller's job, as for any reuse of memory.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from hf_memo.planner.bilevel import plan_fingerprint, plan_memory
from hf_memo.planner.plan import MemoryPlan
from hf_memo.profiler.placement import mark_owned
from hf_memo.profiler.trace import AllocationTrace


class ArenaWarning(UserWarning):
    """The arena served a request by a normal allocation (no plan, other shapes, or an overlap)."""


class Arena:
    """Planned views into one ``torch.uint8`` buffer of ``plan.arena_size`` bytes on ``device``.

    Args:
        plan: the plan to follow; ``None``, or a plan whose arena is not used (``arena_used``), serves every
            request by a normal allocation.
        device: where the buffer lives (``"cuda"``, ``"cpu"``, ...).
        fingerprint: the fingerprint of the run's own trace, when known
            (:func:`hf_memo.planner.bilevel.plan_fingerprint`); a plan made for another trace is not
            used (warning), since its lifetimes and sizes belong to other shapes.
    """

    def __init__(self, plan: MemoryPlan | None, device: torch.device | str, fingerprint: str | None = None) -> None:
        self.device = torch.device(device)
        if plan is not None and fingerprint is not None and plan.fingerprint != fingerprint:
            warnings.warn(
                f"the memory plan was made for trace {plan.fingerprint}, this run's trace is {fingerprint} "
                "(other sequence length, batch or model?); buffers come from the caching allocator",
                ArenaWarning,
                stacklevel=2,
            )
            plan = None
        if plan is not None and not plan.arena_used:
            plan = None
        self.plan = plan
        size = plan.arena_size if plan is not None else 0
        self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._taken: dict[str, tuple[int, int]] = {}  # name -> (offset, bytes) of planned views in use
        self._warned: set[str] = set()

    @classmethod
    def for_trace(
        cls,
        trace: AllocationTrace,
        device: torch.device | str,
        plan: MemoryPlan | None = None,
        solver: str = "cpsat",
        time_limit: float = 10.0,
    ) -> Arena:
        """An arena for a run whose step trace is ``trace``: ``plan`` if it was made for it, else a new plan.

        ``solver="off"`` gives an arena without a plan (every buffer from the caching allocator).
        """
        if solver == "off":
            return cls(None, device)
        fingerprint = plan_fingerprint(trace)
        if plan is None or plan.fingerprint != fingerprint:
            if plan is not None:
                warnings.warn(
                    f"the memory plan was made for trace {plan.fingerprint}, this run's trace is {fingerprint}; "
                    "re-planning",
                    ArenaWarning,
                    stacklevel=2,
                )
            plan = plan_memory(trace, solver=solver, time_limit=time_limit, progress=False)
        return cls(plan, device, fingerprint)

    @property
    def planned(self) -> bool:
        """Whether requests are served from the plan (else every buffer is a normal allocation)."""
        return self.plan is not None

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` for buffer ``name``, uninitialised.

        Planned: a view of the arena at the name's offset, reserved until :meth:`release`.
        Otherwise (see the module docstring): a fresh allocation tagged with ``name``.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        planned = self._planned_offset(name, nbytes, itemsize)
        if planned is None:
            return mark_owned(torch.empty(tuple(shape), dtype=dtype, device=self.device), name)
        self._taken[name] = (planned, nbytes)
        return self.buffer[planned : planned + nbytes].view(dtype).view(tuple(shape))

    def release(self, name: str) -> None:
        """Give ``name``'s planned memory back (nothing to do for buffers that were normal allocations)."""
        self._taken.pop(name, None)

    def _planned_offset(self, name: str, nbytes: int, itemsize: int) -> int | None:
        if self.plan is None:
            return None
        if name not in self.plan.arena_offsets:
            return self._decline(name, f"buffer {name!r} is not in the memory plan")
        if nbytes > self.plan.arena_sizes[name]:
            return self._decline(
                name,
                f"buffer {name!r} needs {nbytes} bytes, the plan has {self.plan.arena_sizes[name]} "
                "(made for other shapes?)",
            )
        if name in self._taken:
            return self._decline(name, f"buffer {name!r} is taken again before it was released")
        offset = self.plan.arena_offsets[name]
        if offset % itemsize:
            return self._decline(name, f"buffer {name!r} has offset {offset}, not aligned to its {itemsize}-byte dtype")
        for other, (other_offset, other_bytes) in self._taken.items():
            if offset < other_offset + other_bytes and other_offset < offset + nbytes:
                return self._decline(
                    name,
                    f"buffer {name!r} would overlap {other!r}, which is still taken (the run's buffer "
                    "lifetimes differ from the plan's)",
                )
        return offset

    def _decline(self, name: str, reason: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(f"{reason}; allocating it normally", ArenaWarning, stacklevel=4)
        return None
