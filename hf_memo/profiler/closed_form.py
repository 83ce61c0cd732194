"""A step's peak memory in closed form: each phase's peak as a line in the step's sizes, fitted to a few profiles.

:mod:`.extrapolate` cuts a trace into runs of one phase ("slots": the embedding, the first and last decoder
layer in each direction, the head, the optimizer) and shows that each slot's peak, by category, is linear in
the number of layers ``n``. It is also linear in the tokens ``T = B * S`` at a fixed depth (every tensor of a
step is a fixed number of rows of tokens, or does not depend on them), and the bytes alive when a slot starts
grow with the layers before it, so the slot's peak is bilinear: ``c0 + c1 n + c2 T + c3 n T``. Chunked ops
(mini-sequence MLP and LM head) add the rows of their largest chunk: the transient of one chunk is
``L_mlp`` or ``L_head`` rows, whatever the chunk count. With features ``x = (1, n, T, nT, L_mlp, L_head)``,
each slot's peak by category is ``x · c`` for one coefficient vector per slot and category; six profiles with
independent features fix them, and the step's peak at any size is the highest slot's value, computed at once.
Profiles of modes that chunk nothing leave the last two features out (four profiles).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hf_memo.profiler.analysis import Peak
from hf_memo.profiler.extrapolate import SlotsOf, slot_names, slot_walk, target_phase
from hf_memo.profiler.trace import CATEGORIES, AllocationEvent, AllocationTrace

MomentKey = tuple[str, int, str]  # (slot, occurrence, op)


Bucketed = Callable[[AllocationEvent], bool]


def moment_peaks(
    trace: AllocationTrace,
    location: str = "device",
    bucketed: Bucketed | None = None,
    slots_of: SlotsOf | None = None,
) -> dict[MomentKey, tuple[Peak, dict[str, int]]]:
    """Per slot (see :func:`~hf_memo.profiler.extrapolate.slot_peaks`) and per op, the most bytes alive right after
    a malloc that op made in the slot (``"start"``: when the slot begins), and of them, by category, the bytes of
    buffers sized for the step's length bucket (the mallocs ``bucketed`` tells; none without it). ``slots_of`` names
    each phase's slots (see :func:`~hf_memo.profiler.extrapolate.slot_walk`).

    A slot's peak is the highest of its moments'. Moments of one op are alike whatever the chunk count (the
    same op at the same point of each chunk), so each is one line in the step's sizes, where a whole slot's
    peak may switch from one kind of moment to another (a chunk's transient when chunks are long, attention's
    backward when they are short).
    """
    peaks: dict[MomentKey, tuple[Peak, dict[str, int]]] = {}
    in_buckets = dict.fromkeys(CATEGORIES, 0)
    sized: set[int] = set()  # tensor ids of the live bucket-sized buffers
    for index, event, slot_keys, starts, live, by_category in slot_walk(trace, location, slots_of):
        if not starts and bucketed is not None:
            if event.op == "malloc" and bucketed(event):
                sized.add(event.tensor_id)
                in_buckets[event.category] += event.size
            elif event.op == "free" and event.tensor_id in sized:
                sized.discard(event.tensor_id)
                in_buckets[event.category] -= event.size
        for slot_key in slot_keys:
            if starts:
                peaks[(*slot_key, "start")] = (Peak(live, dict(by_category), index, event.phase), dict(in_buckets))
            elif event.op == "malloc":
                key = (*slot_key, event.source or "tracked")
                if key not in peaks or live > peaks[key][0].total:
                    peaks[key] = (Peak(live, dict(by_category), index, event.phase), dict(in_buckets))
    return peaks


@dataclass(frozen=True)
class StepSize:
    """The sizes a step's memory depends on: decoder layers, tokens ``B * S`` and the largest chunks' rows.

    ``mlp_rows`` / ``head_rows`` are the tokens of the largest mini-sequence chunk of the MLP and of the LM head
    (``None`` for modes that do not chunk them). Without ``layer_terms`` (profiles of the whole model at one
    depth) the features leave ``n`` and ``nT`` out. ``stretch`` is how much larger than the step's own bytes the
    buffers sized for its length bucket are (the memo runtime's host and copy buffers: see
    :mod:`hf_memo.runtime.buckets`).
    """

    layers: int
    tokens: int
    mlp_rows: int | None = None
    head_rows: int | None = None
    layer_terms: bool = True
    stretch: float = 1.0  # bucket-sized buffers hold this many times their step's bytes (see ClosedForm)

    def slots(self, phase: str) -> tuple[str, ...]:
        """The slots of ``phase`` in a step of this size (none for a middle layer's, never a peak of its own)."""
        return slot_names(phase, self.layers)

    def phase(self, slot: str) -> str | None:
        """The phase ``slot`` names in a step of this size (every slot of a profile has one at every size)."""
        return target_phase(slot, self.layers)

    def features(self) -> np.ndarray:
        """``(1, n, T, nT[, L_mlp, L_head])`` as float64 (``(1, T[, L_mlp, L_head])`` without layer terms)."""
        n, t = float(self.layers), float(self.tokens)
        base = [1.0, n, t, n * t] if self.layer_terms else [1.0, t]
        if self.mlp_rows is None or self.head_rows is None:
            return np.array(base)
        return np.array(base + [float(self.mlp_rows), float(self.head_rows)])


Restate = Callable[[np.ndarray], np.ndarray]
"""``restate(values)``: moments' bytes by category ``(moments, len(CATEGORIES))`` -> the bytes that count."""


class ClosedForm:
    """Per-slot, per-category lines fitted to profiles of one step at several sizes.

    Buffers sized for the step's length bucket (what ``bucketed`` tells, e.g. the memo runtime's host buffers)
    hold ``stretch`` times what the step needs: their bytes are fitted apart, divided by each profile's stretch,
    and multiplied by the stretch of the size asked about.

    Args:
        samples: ``(size, trace)`` pairs, as many as there are features (or more: least squares); every trace
            must have the same slots (same phases) and the sizes' features must be linearly independent.
        location: ``"device"`` or ``"host"``.
        bucketed: ``bucketed(malloc_event)`` -> whether that storage is sized for the length bucket.
    """

    def __init__(
        self,
        samples: Sequence[tuple[StepSize, AllocationTrace]],
        location: str = "device",
        bucketed: Bucketed | None = None,
    ) -> None:
        features = np.stack([size.features() for size, _ in samples])
        if features.shape[0] < features.shape[1] or np.linalg.matrix_rank(features) < features.shape[1]:
            raise ValueError(
                f"need {features.shape[1]} profiles with independent sizes to fit a closed form, got "
                f"{[size for size, _ in samples]}"
            )
        slots = [moment_peaks(trace, location, bucketed, size.slots) for size, trace in samples]
        phases = {key[:2] for key in slots[0]}
        for size, found in zip((size for size, _ in samples), slots):
            if {key[:2] for key in found} != phases:
                raise ValueError(
                    f"the profile at {size} has other phases than the first "
                    f"({sorted(phases ^ {key[:2] for key in found})}); profile at a size in the same regime"
                )
        keys = [key for key in slots[0] if all(key in found for found in slots)]  # moments every profile has
        self.width = features.shape[1]
        self.location = location
        totals = np.array([[[s[k][0].by_category[c] for c in CATEGORIES] for k in keys] for s in slots], dtype=float)
        sized = np.array([[[s[k][1][c] for c in CATEGORIES] for k in keys] for s in slots], dtype=float)
        unsized = totals - sized
        sized /= np.array([size.stretch for size, _ in samples])[:, None, None]  # as if sized for the step itself
        shape = (self.width, len(keys), len(CATEGORIES))
        self._keys: list[MomentKey] = keys
        self._slots = sorted({slot for slot, _, _ in keys})  # a size asks each slot its phase once, not each moment
        self._slot_of_key = np.array([self._slots.index(slot) for slot, _, _ in keys], dtype=np.int64)
        self._coefficients = np.linalg.lstsq(features, unsized.reshape(len(samples), -1), rcond=None)[0].reshape(shape)
        self._sized = np.linalg.lstsq(features, sized.reshape(len(samples), -1), rcond=None)[0].reshape(shape)

    def _moments(self, size: StepSize, restate: Restate | None) -> tuple[np.ndarray, list[str | None]]:
        """Every moment's bytes by category at ``size`` (restated), and each slot's phase at that size."""
        x = size.features()
        if x.shape[0] != self.width:
            raise ValueError(f"this closed form takes sizes with {self.width} features, got {size}")
        coefficients = self._coefficients + size.stretch * self._sized
        values = np.rint(np.einsum("f,fkc->kc", x, coefficients)).astype(np.int64)
        if restate is not None:
            values = restate(values)
        return values, [size.phase(slot) for slot in self._slots]

    def peak(self, size: StepSize, restate: Restate | None = None) -> Peak:
        """The peak at ``location`` of the step of ``size``: the highest slot's value, by category. ``restate`` maps
        every moment's bytes by category (``(moments, len(CATEGORIES))``) to those that count before the highest is
        chosen: e.g. the model states as a DeepSpeed rank holds them, which differ between forward and backward, in
        place of the profile's."""
        values, phases = self._moments(size, restate)
        has = np.array([phase is not None for phase in phases])[self._slot_of_key]  # the slots this size has
        totals = np.where(has, values.sum(axis=1), 0)
        best = int(np.argmax(totals))
        if totals[best] <= 0:
            return Peak(0)
        by_category = {c: int(v) for c, v in zip(CATEGORIES, values[best])}
        return Peak(int(totals[best]), by_category, -1, phases[self._slot_of_key[best]])

    def phase_peaks(self, size: StepSize) -> dict[str, int]:
        """Each phase's highest moment at ``size`` (bytes), for the phases whose slots this size has: what a profile
        of that size holds at its highest in each phase (:func:`~hf_memo.profiler.analysis.phase_peaks`)."""
        values, phases = self._moments(size, None)
        highest: dict[str, int] = {}
        for total, slot in zip(values.sum(axis=1).tolist(), self._slot_of_key.tolist()):
            phase = phases[slot]
            if phase is not None:
                highest[phase] = max(highest.get(phase, 0), total)
        return highest
