"""Allocation traces in MEMO's format (``malloc <id> <bytes>`` / ``free <id> <bytes>``), tagged, as JSON lines.

A trace file starts with one header line, then one event per line::

    {"format": "hf_memo-trace", "version": 1, "meta": {"model": "llama-3-8b", "seq_len": 32768}}
    {"op": "malloc", "id": 7, "bytes": 4096, "phase": "layer 0 forward", "category": "activation", "location": "device"}
    {"op": "free", "id": 7, "bytes": 4096, "phase": "layer 0 backward", "category": "activation", "location": "device"}

``phase`` is where the request happened (``"embedding"``, ``"layer <i> forward"``, ``"layer <i> backward"``,
``"head"``, ``"optimizer"``, ``"other"``); ``category`` what the tensor holds (``"parameter"``,
``"buffer"``, ``"gradient"``, ``"optimizer"``, ``"activation"``, ``"temporary"``); ``location``
``"device"`` or ``"host"`` (offloaded tensors); ``name``, only present on buffers hf_memo owns, the
stable name the runtime allocates them under. A ``free`` repeats its ``malloc``'s id and size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "hf_memo-trace"
VERSION = 1
OPS = ("malloc", "free")
CATEGORIES = ("parameter", "buffer", "gradient", "optimizer", "activation", "temporary")
LOCATIONS = ("device", "host")


@dataclass(frozen=True)
class AllocationEvent:
    """One allocation request: ``op`` of ``size`` bytes for tensor ``tensor_id``, with its tags."""

    op: str
    tensor_id: int
    size: int
    phase: str = "other"
    category: str = "temporary"
    location: str = "device"
    name: str | None = None
    source: str | None = field(default=None, compare=False)  # the op whose output a malloc holds (not saved)

    def to_json(self) -> dict[str, Any]:
        record = {
            "op": self.op,
            "id": self.tensor_id,
            "bytes": self.size,
            "phase": self.phase,
            "category": self.category,
            "location": self.location,
        }
        if self.name is not None:
            record["name"] = self.name
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> AllocationEvent:
        return cls(
            op=record["op"],
            tensor_id=int(record["id"]),
            size=int(record["bytes"]),
            phase=record.get("phase", "other"),
            category=record.get("category", "temporary"),
            location=record.get("location", "device"),
            name=record.get("name"),
        )


@dataclass
class AllocationTrace:
    """An ordered list of :class:`AllocationEvent` plus free-form metadata (model, seq_len, mode, ...)."""

    events: list[AllocationEvent]
    meta: dict[str, Any] = field(default_factory=dict)

    def as_tuples(self, location: str | None = "device") -> list[tuple[str, int, int]]:
        """The events as MEMO's ``(op, tensor_id, bytes)`` tuples, optionally only those at ``location``."""
        return [(e.op, e.tensor_id, e.size) for e in self.events if location is None or e.location == location]

    def select(self, phases: Iterable[str]) -> AllocationTrace:
        """The events whose phase is one of ``phases``, in order (meta is kept)."""
        wanted = set(phases)
        return AllocationTrace([e for e in self.events if e.phase in wanted], dict(self.meta))

    def save(self, path: str | Path) -> None:
        """Write the trace as JSON lines (header first)."""
        with open(path, "w") as handle:
            handle.write(json.dumps({"format": FORMAT, "version": VERSION, "meta": self.meta}) + "\n")
            for event in self.events:
                handle.write(json.dumps(event.to_json()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> AllocationTrace:
        """Read a trace written by :meth:`save`; ``ValueError`` names the line of anything malformed."""
        events: list[AllocationEvent] = []
        meta: dict[str, Any] = {}
        with open(path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    if number == 1 and record.get("format") == FORMAT:
                        meta = dict(record.get("meta", {}))
                        continue
                    event = AllocationEvent.from_json(record)
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
                    raise ValueError(f"{path}:{number}: not a trace event ({error})") from None
                if event.op not in OPS:
                    raise ValueError(f"{path}:{number}: op must be one of {', '.join(OPS)}, got {event.op!r}")
                events.append(event)
        return cls(events, meta)
