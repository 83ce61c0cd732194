"""Tensor lifetimes of an allocation trace: the input of Dynamic Storage Allocation (DSA).

A trace is MEMO's list of requests in order, ``[("malloc", tensor_id, bytes), ("free", tensor_id,
bytes), ...]``. Event ``t`` is the ``t``-th request; a tensor malloc'd at event ``s`` and freed at
event ``e`` lives over the half-open interval ``[s, e)``; a tensor never freed lives to the end
(``e = len(events)``). Two tensors may share memory exactly when their intervals do not intersect.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_memo.profiler.trace import AllocationTrace


@dataclass(frozen=True)
class Lifetime:
    """Tensor ``tensor_id`` of ``size`` bytes, alive over events ``[start, end)``."""

    tensor_id: int
    size: int
    start: int
    end: int


def _round_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


class Trace:
    """The lifetimes of the tensors of one allocation trace, in malloc order.

    Build it with :meth:`from_events` (MEMO tuples), :meth:`from_allocations` (a profiler
    :class:`~hf_memo.profiler.trace.AllocationTrace`), :meth:`load` (a profiler trace file) or directly
    from lifetimes (sub-problems of the bi-level planner). ``names`` maps the ids of buffers hf_memo
    owns to their stable names.
    """

    def __init__(self, lifetimes: Iterable[Lifetime], length: int, names: Mapping[int, str] | None = None) -> None:
        self.lifetimes: tuple[Lifetime, ...] = tuple(sorted(lifetimes, key=lambda life: (life.start, life.tensor_id)))
        self.length = length
        self.names: dict[int, str] = dict(names or {})
        seen: set[int] = set()
        for life in self.lifetimes:
            if life.tensor_id in seen:
                raise ValueError(f"tensor id {life.tensor_id} appears in two lifetimes; ids must be unique")
            seen.add(life.tensor_id)
            if life.size <= 0:
                raise ValueError(f"tensor {life.tensor_id} has size {life.size}; sizes must be > 0 bytes")
            if not 0 <= life.start < life.end <= length:
                raise ValueError(
                    f"tensor {life.tensor_id} lives over [{life.start}, {life.end}), "
                    f"which is not a non-empty interval inside [0, {length})"
                )

    @classmethod
    def from_events(cls, events: Iterable[Sequence], names: Mapping[int, str] | None = None) -> Trace:
        """Lifetimes of MEMO events ``(op, tensor_id, bytes)``; ``ValueError`` names the first bad event.

        Rejected: an op other than ``"malloc"``/``"free"``, a size that is not an int > 0, a malloc of
        an id already used in the trace, a free of an id never allocated or already freed, and a free
        whose size differs from its malloc's.
        """
        starts: dict[int, tuple[int, int]] = {}
        ends: dict[int, int] = {}
        length = 0
        for index, event in enumerate(events):
            length = index + 1
            where = f"event {index} {tuple(event)!r}"
            if len(event) != 3:
                raise ValueError(f"{where}: an event is (op, tensor_id, bytes)")
            op, tensor_id, size = event
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ValueError(f"{where}: size must be an int > 0 bytes, got {size!r}")
            if op == "malloc":
                if tensor_id in starts:
                    state = "freed" if tensor_id in ends else "still live"
                    raise ValueError(
                        f"{where}: malloc of tensor {tensor_id}, which was allocated before ({state}); "
                        "tensor ids must be unique within a trace"
                    )
                starts[tensor_id] = (index, size)
            elif op == "free":
                if tensor_id not in starts:
                    raise ValueError(f"{where}: free before malloc of tensor {tensor_id}")
                if tensor_id in ends:
                    raise ValueError(
                        f"{where}: double free of tensor {tensor_id} (first freed at event {ends[tensor_id]})"
                    )
                allocated = starts[tensor_id][1]
                if size != allocated:
                    raise ValueError(
                        f"{where}: size mismatch, tensor {tensor_id} was allocated with {allocated} bytes, "
                        f"freed with {size}"
                    )
                ends[tensor_id] = index
            else:
                raise ValueError(f'{where}: op must be "malloc" or "free", got {op!r}')
        lifetimes = [
            Lifetime(tensor_id, size, start, ends.get(tensor_id, length)) for tensor_id, (start, size) in starts.items()
        ]
        return cls(lifetimes, length, {k: v for k, v in (names or {}).items() if k in starts})

    @classmethod
    def from_allocations(cls, trace: AllocationTrace, location: str | None = "device") -> Trace:
        """Lifetimes of a profiler trace's events at ``location`` (``None``: all), with owned-buffer names."""
        events = [e for e in trace.events if location is None or e.location == location]
        names = {e.tensor_id: e.name for e in events if e.op == "malloc" and e.name is not None}
        return cls.from_events([(e.op, e.tensor_id, e.size) for e in events], names)

    @classmethod
    def load(cls, path: str | Path, location: str | None = "device") -> Trace:
        """Lifetimes of a profiler trace file (JSON lines, see :mod:`hf_memo.profiler.trace`)."""
        return cls.from_allocations(AllocationTrace.load(path), location)

    def __len__(self) -> int:
        return len(self.lifetimes)

    def live_bytes(self, alignment: int = 1) -> list[int]:
        """Bytes live during each event ``t`` (sizes rounded up to ``alignment``), a list of ``length``."""
        delta = [0] * (self.length + 1)
        for life in self.lifetimes:
            size = _round_up(life.size, alignment)
            delta[life.start] += size
            delta[life.end] -= size
        live, total = [], 0
        for change in delta[:-1]:
            total += change
            live.append(total)
        return live

    def lower_bound(self, alignment: int = 1) -> int:
        """Most bytes live at once (sizes rounded up to ``alignment``): no placement can need less."""
        return max(self.live_bytes(alignment), default=0)

    def events(self) -> list[tuple[str, int, int]]:
        """The MEMO events these lifetimes stand for, in time order (frees before mallocs at equal times)."""
        stamped = [(life.start, 1, "malloc", life) for life in self.lifetimes]
        stamped += [(life.end, 0, "free", life) for life in self.lifetimes if life.end < self.length]
        stamped.sort(key=lambda item: (item[0], item[1], item[3].tensor_id))
        return [(op, life.tensor_id, life.size) for _, _, op, life in stamped]

    def fingerprint(self) -> str:
        """Hash of the events with ids renumbered in malloc order: equal for equal DSA problems.

        Two layers whose requests have the same order and sizes get the same fingerprint, whatever
        their tensor ids; another sequence length or batch changes the sizes, hence the fingerprint.
        """
        renumbered: dict[int, int] = {}
        canonical = []
        for op, tensor_id, size in self.events():
            local = renumbered.setdefault(tensor_id, len(renumbered))
            canonical.append((op[0], local, size))
        return hashlib.sha256(json.dumps(canonical).encode()).hexdigest()[:16]
