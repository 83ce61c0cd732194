"""Reading an allocation trace: live bytes over time, the peak and its breakdown, per-layer traces."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hf_memo.profiler.trace import CATEGORIES, AllocationEvent, AllocationTrace

DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Peak:
    """The most bytes alive at once at one location, what they hold, and when (event index and phase)."""

    total: int
    by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    index: int = -1
    phase: str = "other"


def live_bytes(trace: AllocationTrace, location: str = "device") -> list[int]:
    """Bytes alive at ``location`` after each event of the trace (one entry per event, all locations)."""
    live, curve = 0, []
    for event in trace.events:
        if event.location == location:
            live += event.size if event.op == "malloc" else -event.size
        curve.append(live)
    return curve


def peak(
    trace: AllocationTrace, location: str = "device", restate: Callable[[np.ndarray], np.ndarray] | None = None
) -> Peak:
    """The first moment the bytes alive at ``location`` are highest, with their breakdown by category; with
    ``restate``, the bytes that count at each moment are ``restate(bytes by category)`` (``(1, len(CATEGORIES))``,
    e.g. the model states as a DeepSpeed rank holds them in place of the profile's)."""
    by_category = dict.fromkeys(CATEGORIES, 0)
    best = Peak(0, dict(by_category))
    live = 0
    for index, event in enumerate(trace.events):
        if event.location != location:
            continue
        sign = 1 if event.op == "malloc" else -1
        live += sign * event.size
        by_category[event.category] += sign * event.size
        if restate is None:
            if live > best.total:
                best = Peak(live, dict(by_category), index, event.phase)
            continue
        values = restate(np.array([[by_category[c] for c in CATEGORIES]], dtype=np.int64))[0]
        if int(values.sum()) > best.total:
            best = Peak(int(values.sum()), {c: int(v) for c, v in zip(CATEGORIES, values)}, index, event.phase)
    return best


def unfreed(trace: AllocationTrace) -> list[int]:
    """Ids of the tensors malloc'd and never freed in the trace, in id order."""
    alive: set[int] = set()
    for event in trace.events:
        (alive.add if event.op == "malloc" else alive.discard)(event.tensor_id)
    return sorted(alive)


def layer_trace(trace: AllocationTrace, layer: int, direction: str, own: bool = False) -> AllocationTrace:
    """The events of decoder layer ``layer``'s ``"forward"`` or ``"backward"`` phase, in order.

    With ``own``, only events of tensors the layer allocated (in its forward or backward): frees of
    tensors made elsewhere are dropped. Which layer releases those depends on its position, not on
    the layer: the model keeps the embedding output until its forward returns, the first layer's
    backward releases the rotary tables all layers saved, a layer's input is released after the
    layer returns.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    selected = trace.select([f"layer {layer} {direction}"])
    if own:
        phases = {f"layer {layer} {d}" for d in DIRECTIONS}
        mine = {e.tensor_id for e in trace.events if e.op == "malloc" and e.phase in phases}
        selected.events = [e for e in selected.events if e.tensor_id in mine]
    return selected


def canonical(events: list[AllocationEvent]) -> list[tuple[str, int, int, str, str]]:
    """``(op, id, bytes, category, location)`` with ids renumbered by first appearance, to compare segments.

    Owned-buffer names are left out: the runtime may name buffers per layer.
    """
    numbers: dict[int, int] = {}
    return [(e.op, numbers.setdefault(e.tensor_id, len(numbers)), e.size, e.category, e.location) for e in events]


def layer_count(trace: AllocationTrace) -> int:
    """Decoder layers the trace covers (``meta["layers"]``, else the highest layer phase + 1)."""
    if "layers" in trace.meta:
        return int(trace.meta["layers"])
    return 1 + max((int(e.phase.split()[1]) for e in trace.events if e.phase.startswith("layer ")), default=-1)


def differing_layers(trace: AllocationTrace) -> list[str]:
    """The layer phases whose own trace (see :func:`layer_trace`) differs from most layers' (empty when all agree).

    Ties go to the lowest layer: with two different layers, layer 1 is reported.
    """
    different = []
    layers = range(layer_count(trace))
    for direction in DIRECTIONS:
        traces = [tuple(canonical(layer_trace(trace, i, direction, own=True).events)) for i in layers]
        if not traces:
            continue
        reference = Counter(traces).most_common(1)[0][0]
        different += [f"layer {i} {direction}" for i, t in enumerate(traces) if t != reference]
    return different


def check_identical_layers(trace: AllocationTrace) -> None:
    """Raise ``ValueError`` naming the decoder layers whose forward or backward trace differs from the others'."""
    different = differing_layers(trace)
    if different:
        raise ValueError(f"decoder layers whose allocation trace differs from the others': {', '.join(different)}")
