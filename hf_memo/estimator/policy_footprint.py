"""The memory of one memo policy at any length and any layer counts, from fresh profiles of that policy.

A memory policy (:class:`~hf_memo.planner.policy.MemoryPolicy`) is a stack of blocks of identical layers (what the
policy solver picks: host layers at the bottom, device layers on top, each kind with one or two alphas). The
runtime is told to run exactly such a policy (:meth:`~hf_memo.runtime.memo.MemoRuntime.assume_policy`) and the step
is profiled on fake tensors, so what is measured is the code's own allocations, working sets included.

Within a block every layer does the same, so the bytes alive at any moment of a layer's forward or backward grow
linearly with the layers of each block before and after it. A block's end layers differ from its middle ones (the
layer below the first is of another kind or none: the bottom host layer fetches nothing below it), and the middle
layers' peaks move linearly from the second's to the last but one's. A layer's forward also depends on the two
layers below it: the one below's swapped stash is still being copied out (its device tensors are held until the
next seal), and in the bottom block that costs nothing while the second layer runs, the bottom layer's input being
the embeddings' output, which the step holds anyway. So the bottom block is profiled from four layers (its last but
one is then in the steady state), the others from three, and a forward is read off the line of the slot that shares
its layers below: a block's second layer's forward off the "second" line even when it is the block's last, a
block's single layer's off the "first" line. With one slot per block end, second and last but one layer and
direction, each moment's bytes are a line in ``(1, T, c_1, c_1 T, ..., c_k, c_k T, L_mlp, L_head)`` for block
counts ``c_i``, tokens ``T`` and the largest chunks' rows (see :mod:`hf_memo.profiler.closed_form`). ``2k + 4``
profiles fix it: every block at its base count and each block in turn at one more, at two lengths, plus two with
one more MLP or LM-head chunk.

Two cases are off the profile. The first layer of the second block when the bottom block is a single layer is above
it, by at most the bottom layer's stash (the layer below then swaps its stash for free, which no fitted profile
shows). And where a CUDA target's flash forward splits the keys (few heads per rank, short chunks), its split-key
buffers change in steps with the length, not on a line: a forward moment holding them is off by up to one call's
buffers (a few MiB at Llama-3-8B's shapes, under SP 8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from hf_memo.estimator.fitted import PROFILE_SEQ_LEN, ConfigFacts, chunk_rows, sized_for_bucket
from hf_memo.estimator.setups import AUTO_CHUNKS, Chunks
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.profiler.analysis import Peak
from hf_memo.profiler.closed_form import ClosedForm, Restate
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.runtime.buckets import stretch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FIT_COUNT = 3  # layers per block in the base profiles (the copy buffers are all in use from the third)
BOTTOM_FIT_COUNT = 4  # the bottom block's: its third layer's forward is the first in the steady state
ALPHA_DENOMINATOR = 64  # alphas are fractions j / d with d at most this (the solvers' grids: 1/16 at the finest)


def alpha_chunks(kinds: Sequence[LayerPolicy]) -> int:
    """The fewest MLP chunks (at least 2) in which every alpha of ``kinds`` is whole chunks: profiles cut this many,
    so the executor rounds no alpha down (alphas are fractions ``j / d``, ``d <= ALPHA_DENOMINATOR``)."""
    lcm = 2
    for kind in kinds:
        denominator = Fraction(kind.alpha).limit_denominator(ALPHA_DENOMINATOR).denominator
        lcm = lcm * denominator // math.gcd(lcm, denominator)
    return lcm


@dataclass(frozen=True)
class PolicyShape:
    """A policy as blocks of identical layers, bottom first: each block's layer policy and its layer count."""

    kinds: tuple[LayerPolicy, ...]
    counts: tuple[int, ...]

    @classmethod
    def of(cls, policy: MemoryPolicy) -> PolicyShape:
        kinds: list[LayerPolicy] = []
        counts: list[int] = []
        for layer in policy.layers:
            if kinds and kinds[-1] == layer:
                counts[-1] += 1
            else:
                kinds.append(layer)
                counts.append(1)
        return cls(tuple(kinds), tuple(counts))

    @property
    def layers(self) -> int:
        return sum(self.counts)

    def policy(self) -> MemoryPolicy:
        """The policy of this shape (every layer's, bottom first)."""
        return MemoryPolicy(tuple(kind for kind, count in zip(self.kinds, self.counts) for _ in range(count)))

    def with_counts(self, counts: Sequence[int]) -> PolicyShape:
        return PolicyShape(self.kinds, tuple(counts))

    def block_of(self, layer: int) -> tuple[int, int]:
        """``(block, position in the block)`` of decoder layer ``layer``."""
        start = 0
        for block, count in enumerate(self.counts):
            if layer < start + count:
                return block, layer - start
            start += count
        raise ValueError(f"layer {layer} is past the policy's {self.layers} layers")


@dataclass(frozen=True)
class PolicySize:
    """The sizes a policy's step memory depends on: its blocks' layer counts, the tokens ``B * S`` and the rows of
    the largest MLP and LM-head chunks; ``stretch`` as in :class:`~hf_memo.profiler.closed_form.StepSize`."""

    shape: PolicyShape
    tokens: int
    mlp_rows: int
    head_rows: int
    stretch: float = 1.0

    def features(self) -> np.ndarray:
        """``(1, T, c_1, c_1 T, ..., c_k, c_k T, L_mlp, L_head)`` as float64."""
        t = float(self.tokens)
        per_block = [value for count in self.shape.counts for value in (float(count), count * t)]
        return np.array([1.0, t, *per_block, float(self.mlp_rows), float(self.head_rows)])

    def slots(self, phase: str) -> tuple[str, ...]:
        """``("block 1 first backward",)`` for the end layers of each block, ``"... second ..."`` and
        ``"... penultimate ..."`` for the middle layers next to them (both for the middle of three), none for the
        others: a middle layer peaks like its neighbours but for what accumulates layer by layer, so no higher than
        the second's or the last but one's, while an end layer's neighbour may be of another kind (or none)."""
        if not phase.startswith("layer "):
            return (phase,)
        _, index, direction = phase.split()
        block, position = self.shape.block_of(int(index))
        last = self.shape.counts[block] - 1
        if position in (0, last):
            return (f"block {block} {'first' if position == 0 else 'last'} {direction}",)
        return tuple(
            f"block {block} {name} {direction}"
            for name, at in (("second", 1), ("penultimate", last - 1))
            if position == at
        )

    def phase(self, slot: str) -> str | None:
        """The phase of ``slot`` at this size; ``None`` where the slot's line does not describe that layer: a middle
        slot of a block of fewer than three layers, and in the forward, which depends on the layers below, an end
        slot whose layer has fewer than two layers below it in the block (read off the "first" or "second" line)."""
        if not slot.startswith("block "):
            return slot
        _, block, end, direction = slot.split()
        count = self.shape.counts[int(block)]
        position = {"first": 0, "second": 1, "penultimate": count - 2, "last": count - 1}[end]
        if direction == "forward":
            if end in ("penultimate", "last") and position < 2 or end == "second" and count < 2:
                return None
        elif end in ("second", "penultimate") and count < 3:
            return None
        return f"layer {sum(self.shape.counts[: int(block)]) + position} {direction}"


ProfilerFor = Callable[[MemoryPolicy, Chunks], StepProfiler]
PolicyPoint = tuple[tuple[int, ...], int, Chunks]  # (block counts, seq_len, chunk settings) of one profile


def fit_points(kinds: Sequence[LayerPolicy], max_seq_len: int = 1 << 24) -> list[PolicyPoint]:
    """The profiles a shape's closed form is fitted to (see the module docstring)."""
    longer = min(PROFILE_SEQ_LEN, max_seq_len - max_seq_len % 2)
    mlp = alpha_chunks(kinds)
    base = (BOTTOM_FIT_COUNT,) + (FIT_COUNT,) * (len(kinds) - 1)
    configs = [base] + [base[:i] + (base[i] + 1,) + base[i + 1 :] for i in range(len(kinds))]
    points: list[PolicyPoint] = [(c, s, (mlp, 2)) for c in configs for s in (longer // 2, longer)]
    more = 3 if mlp == 2 and all(kind.alpha in (0.0, 1.0) for kind in kinds) else 2 * mlp  # alphas stay whole
    return points + [(base, longer, (more, 2)), (base, longer, (mlp, 3))]


def _trace(profiler_for: ProfilerFor, kinds: tuple[LayerPolicy, ...], point: PolicyPoint) -> AllocationTrace:
    counts, seq_len, chunks = point
    shape = PolicyShape(kinds, counts)
    return profiler_for(shape.policy(), chunks).trace(seq_len, shape.layers)


def fit_jobs(
    profiler_for: ProfilerFor, kinds: tuple[LayerPolicy, ...], max_seq_len: int = 1 << 24
) -> list[Callable[[], AllocationTrace]]:
    """:func:`fit_points`' profiles as jobs (each builds a fresh model)."""
    return [partial(_trace, profiler_for, kinds, point) for point in fit_points(kinds, max_seq_len)]


class PolicyFootprint:
    """Peak device and host bytes of every policy of one block structure (``kinds``) at any length and counts.

    Args:
        kinds: the blocks' layer policies, bottom first.
        config: the model's config (chunk rows follow the runtime's rule for it).
        batch_size: sequences per step.
        traces: the profiles of :func:`fit_jobs` in their order.
        max_seq_len: the longest length the model's positions allow (as given to :func:`fit_jobs`).
    """

    def __init__(
        self,
        kinds: tuple[LayerPolicy, ...],
        config: PretrainedConfig | ConfigFacts,
        batch_size: int,
        traces: Sequence[AllocationTrace],
        max_seq_len: int = 1 << 24,
    ) -> None:
        points = fit_points(kinds, max_seq_len)
        if len(traces) != len(points):
            raise ValueError(f"the fit has {len(points)} profiles, got {len(traces)} traces")
        self.kinds, self.config, self.batch_size = kinds, ConfigFacts.of(config), batch_size
        self.profiles = len(points)
        samples = [
            (self.size(PolicyShape(kinds, counts), seq_len, chunks), trace)
            for (counts, seq_len, chunks), trace in zip(points, traces)
        ]
        self._device = ClosedForm(samples, "device", sized_for_bucket)
        self._host = ClosedForm(samples, "host", sized_for_bucket)

    def size(self, shape: PolicyShape, seq_len: int, chunks: Chunks = AUTO_CHUNKS) -> PolicySize:
        mlp_rows, head_rows = chunk_rows(self.config, "memo", self.batch_size, seq_len, chunks)
        return PolicySize(shape, self.batch_size * seq_len, mlp_rows, head_rows, stretch(seq_len))

    def peaks(
        self, shape: PolicyShape, seq_len: int, chunks: Chunks = AUTO_CHUNKS, restate: Restate | None = None
    ) -> tuple[Peak, Peak]:
        """``(device, host)`` peaks of a step of ``(batch_size, seq_len)`` under ``shape``'s policy, chunked by
        ``chunks`` (default: the runtime's rule); the device's moments ``restate``d before the highest is chosen
        (see :meth:`ClosedForm.peak`)."""
        size = self._size_of(shape, seq_len, chunks)
        return self._device.peak(size, restate), self._host.peak(size)

    def device_phase_peaks(self, shape: PolicyShape, seq_len: int, chunks: Chunks = AUTO_CHUNKS) -> dict[str, int]:
        """Each phase's highest device bytes in a step of ``(batch_size, seq_len)`` under ``shape``'s policy (the
        phases whose slots the shape has: end layers, second and last but one layers, embedding, head)."""
        return self._device.phase_peaks(self._size_of(shape, seq_len, chunks))

    def _size_of(self, shape: PolicyShape, seq_len: int, chunks: Chunks) -> PolicySize:
        if shape.kinds != self.kinds:
            raise ValueError(f"this footprint is of policies made of {self.kinds}, got {shape.kinds}")
        return self.size(shape, seq_len, chunks)
