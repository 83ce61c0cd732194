"""``MemoryPlan``: the bi-level plan of one training step, as JSON.

A plan holds, for the trace it was made for (``fingerprint``, ``meta``):

* ``blocks`` — level-1 solutions, one per distinct layer-phase problem: the offsets of the tensors
  local to that phase, relative to the block's base, in the order they are allocated;
* ``segments`` — each layer phase of the trace (``"layer 3 forward"``, ...): which block it reuses,
  where that block sits (``base``) and which tensor ids fill it;
* ``global_offsets`` — level-2 offsets of every tensor that is not local to a layer phase;
* ``arena_offsets`` / ``arena_sizes`` / ``arena_size`` — the buffers hf_memo owns, by name, placed
  in one arena of ``arena_size`` bytes (what :class:`hf_memo.runtime.arena.Arena` allocates);
* ``peak`` / ``lower_bound`` — bytes the fully planned step needs, and the most bytes ever live;
* ``stats`` — solver statistics per level, and what the replayed caching allocator reserves at peak for
  the step without the arena and with it (``stats["allocator"]``);
* ``arena_used`` — whether the runtime serves its buffers from the arena: ``False`` when the arena would make
  the step reserve more than the caching allocator alone (plans written before this field read as ``True``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hf_memo.planner.dsa import NEAR_OPTIMAL
from hf_memo.units import format_bytes

FORMAT = "hf_memo-plan"
VERSION = 1


@dataclass(frozen=True)
class LayerBlock:
    """A level-1 solution: ``offsets[k]`` is the offset of the ``k``-th tensor allocated in the phase."""

    fingerprint: str
    size: int
    offsets: list[int]


@dataclass(frozen=True)
class Segment:
    """One layer phase: events ``[first_event, last_event]``, placed as ``blocks[block]`` at ``base``."""

    phase: str
    first_event: int
    last_event: int
    block: int
    base: int
    tensor_ids: list[int]


@dataclass
class MemoryPlan:
    """Static offsets for one training step (see the module docstring for the fields)."""

    fingerprint: str
    alignment: int
    peak: int
    lower_bound: int
    blocks: list[LayerBlock]
    segments: list[Segment]
    global_offsets: dict[int, int]
    arena_size: int
    arena_offsets: dict[str, int]
    arena_sizes: dict[str, int]
    meta: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    arena_used: bool = True

    def offsets(self) -> dict[int, int]:
        """Byte offset of every device tensor of the trace, by tensor id (both levels combined)."""
        result = dict(self.global_offsets)
        for segment in self.segments:
            block = self.blocks[segment.block]
            for tensor_id, offset in zip(segment.tensor_ids, block.offsets):
                result[tensor_id] = segment.base + offset
        return result

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["global_offsets"] = [[k, v] for k, v in self.global_offsets.items()]
        return {"format": FORMAT, "version": VERSION, **record}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> MemoryPlan:
        if record.get("format") != FORMAT or record.get("version") != VERSION:
            raise ValueError(
                f"not an hf_memo plan of version {VERSION} (format {record.get('format')!r}, "
                f"version {record.get('version')!r})"
            )
        fields = {k: v for k, v in record.items() if k not in ("format", "version")}
        fields["blocks"] = [LayerBlock(**block) for block in fields["blocks"]]
        fields["segments"] = [Segment(**segment) for segment in fields["segments"]]
        fields["global_offsets"] = {int(k): int(v) for k, v in fields["global_offsets"]}
        return cls(**fields)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> MemoryPlan:
        """Read a plan written by :meth:`save`; ``ValueError`` if the file is not one."""
        try:
            record = json.loads(Path(path).read_text())
            return cls.from_json(record)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{path}: not an hf_memo plan ({error})") from None

    def summary(self) -> str:
        """A few lines for people: peak against the lower bound, and time and optimality per level."""
        ratio = self.peak / self.lower_bound if self.lower_bound else 1.0
        lines = [
            f"plan {self.fingerprint}: peak {format_bytes(self.peak)}, lower bound {format_bytes(self.lower_bound)} "
            f"(x{ratio:.3f}); arena for owned buffers {format_bytes(self.arena_size)} "
            f"({len(self.arena_offsets)} buffers{'' if self.arena_used else ', not used'})"
        ]
        for level in self.stats.get("level1", []):
            label = f"level 1 {level['phases'][0]} (+{len(level['phases']) - 1} identical)"
            lines.append(_level_line(label, level))
        for label, key in (("level 2", "level2"), ("arena", "arena")):
            if key in self.stats:
                lines.append(_level_line(label, self.stats[key]))
        allocator = self.stats.get("allocator")
        if allocator is not None:
            verdict = "used" if self.arena_used else "not used: the caching allocator alone reserves less"
            lines.append(
                f"  caching allocator reserves {format_bytes(allocator['reserved_with_arena'])} with the arena, "
                f"{format_bytes(allocator['reserved'])} without ({verdict})"
            )
        if "seconds" in self.stats:
            lines.append(f"  planned in {self.stats['seconds']:.2f} s")
        return "\n".join(lines)


def _level_line(label: str, level: dict[str, Any]) -> str:
    if level["optimal"]:
        proven = "optimal"
    elif level["peak"] <= level["lower_bound"] * (1 + NEAR_OPTIMAL):
        proven = f"within {NEAR_OPTIMAL:.2%} of the lower bound"
    else:
        proven = "not proven optimal"
    return (
        f"  {label}: {level['tensors']} tensors, x{level['ratio']:.3f}, {proven}, "
        f"{level['seconds']:.2f} s ({level['solver']})"
    )
