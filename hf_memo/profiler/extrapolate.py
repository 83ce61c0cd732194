"""The peak of a deep model from the traces of two shallow copies of it, linear in the number of layers.

Cut a trace into runs of consecutive events of one phase. With identical decoder layers, the bytes
alive during each run are the bytes alive when it starts, which grow linearly with the number of
layers, plus the run's own allocations, which do not depend on it. So the peak of every run is
linear in the layer count, and so is its breakdown by category. The middle layers' runs peak no
higher than the first or last layer's (the level they start at moves linearly from one to the
other), so the runs that matter are those of the embedding, the first and the last layer in each
direction, the head, the optimizer and the rest. Two profiles (``a`` and ``b`` layers) fix each
run's line; the extrapolated peak is the highest run's value at the target depth.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from hf_memo.profiler.analysis import Peak, layer_count
from hf_memo.profiler.trace import CATEGORIES, AllocationEvent, AllocationTrace

SlotKey = tuple[str, int]


def slot_names(phase: str, layers: int) -> tuple[str, ...]:
    """``("layer first forward",)`` / ``("layer last backward",)`` for the end layers, ``()`` for middle ones."""
    if not phase.startswith("layer "):
        return (phase,)
    _, index, direction = phase.split()
    if int(index) == layers - 1:
        return (f"layer last {direction}",)
    if int(index) == 0:
        return (f"layer first {direction}",)
    return ()


SlotsOf = Callable[[str], tuple[str, ...]]


def slot_walk(
    trace: AllocationTrace, location: str = "device", slots_of: SlotsOf | None = None
) -> Iterator[tuple[int, AllocationEvent, tuple[SlotKey, ...], bool, int, dict[str, int]]]:
    """Walk ``trace`` run by run of its phases: ``(index, event, slot keys, starts, live bytes, live by category)``.

    Each run of one phase is keyed ``(slot, occurrence)`` for each slot it stands for (none for middle layers;
    a run may stand for two slots, e.g. a block's second layer that is also its last but one). A run's first
    event is yielded first with ``starts=True`` and the bytes alive before it; every event at ``location`` is then
    yielded with the bytes alive after it. ``live by category`` is updated in place: copy it to keep it.
    ``slots_of(phase)`` names a phase's slots (default :func:`slot_names` at the trace's depth).
    """
    if slots_of is None:
        layers = layer_count(trace)

        def slots_of(phase: str) -> tuple[str, ...]:
            return slot_names(phase, layers)

    by_category = dict.fromkeys(CATEGORIES, 0)
    live = 0
    seen: Counter[str] = Counter()
    keys: tuple[SlotKey, ...] = ()
    previous_phase = None
    for index, event in enumerate(trace.events):
        if event.phase != previous_phase:
            previous_phase = event.phase
            keys = tuple((slot, seen[slot]) for slot in slots_of(event.phase))
            seen.update(slot for slot, _ in keys)
            if keys:
                yield index, event, keys, True, live, by_category
        if event.location == location:
            sign = 1 if event.op == "malloc" else -1
            live += sign * event.size
            by_category[event.category] += sign * event.size
            yield index, event, keys, False, live, by_category


def slot_peaks(trace: AllocationTrace, location: str = "device") -> dict[SlotKey, Peak]:
    """The peak of each run of one phase, keyed by ``(slot, occurrence)`` (middle layers left out)."""
    peaks: dict[SlotKey, Peak] = {}
    for index, event, keys, starts, live, by_category in slot_walk(trace, location):
        for key in keys:
            if starts or live > peaks[key].total:
                peaks[key] = Peak(live, dict(by_category), index, event.phase)
    return peaks


def target_phase(slot: str, layers: int) -> str:
    """The phase name of ``slot`` (``"layer last backward"``, ...) in a model with ``layers`` decoder layers."""
    if slot.startswith("layer first "):
        return f"layer 0 {slot.split()[-1]}"
    if slot.startswith("layer last "):
        return f"layer {layers - 1} {slot.split()[-1]}"
    return slot


def extrapolated_peak(shallow: AllocationTrace, deeper: AllocationTrace, layers: int, location: str = "device") -> Peak:
    """The peak at ``location`` of the same step with ``layers`` decoder layers.

    ``shallow`` and ``deeper`` are traces of the model with fewer layers (at least 2, so the first
    and last layer differ), identical otherwise. The result's ``index`` is -1 (no event of a trace).
    """
    a, b = layer_count(shallow), layer_count(deeper)
    if not 2 <= a < b:
        raise ValueError(f"need profiles of 2 <= a < b layers to extrapolate, got a={a}, b={b}")
    small, large = slot_peaks(shallow, location), slot_peaks(deeper, location)
    if small.keys() != large.keys():
        raise ValueError(
            f"the {a}- and {b}-layer traces do not have the same phases "
            f"({sorted(small.keys() ^ large.keys())}); profile the full model instead"
        )
    best = Peak(0)
    for key, low in small.items():
        high = large[key]
        scale = (layers - a) / (b - a)
        by_category = {
            c: round(low.by_category[c] + scale * (high.by_category[c] - low.by_category[c])) for c in CATEGORIES
        }
        total = sum(by_category.values())
        if total > best.total:
            best = Peak(total, by_category, -1, target_phase(key[0], layers))
    return best
