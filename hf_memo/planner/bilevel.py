"""The bi-level memory plan of a training step: one small DSA per distinct layer phase, one over the step.

Input: a profiler :class:`~hf_memo.profiler.trace.AllocationTrace` of one step whose events carry
their phase (``"embedding"``, ``"layer <i> forward"``, ``"layer <i> backward"``, ``"head"``,
``"optimizer"``, ...). Only device events are planned.

**Segments.** A segment is a maximal run of consecutive events with the same layer phase (a layer's
forward, or its backward; a phase that comes back later, e.g. a recomputation, is a new segment).
A tensor is *local* to a segment when both its malloc and its free happen inside it: the
temporaries of that layer phase. Every other tensor — saved activations (malloc in a layer's
forward, free in its backward), layer inputs and outputs, gradients, embedding/head/optimizer
tensors, tensors never freed — is *global*.

**Level 1.** The local tensors of a segment form a DSA problem of their own. Segments whose local
problems are identical (same fingerprint: same request order and sizes once ids are renumbered,
which is the case for the identical decoder layers of a model) share one solution.

**Level 2.** Each segment becomes one pseudo-tensor: as large as its level-1 peak, alive from the
first malloc to the last free of its local tensors. These pseudo-blocks and all global tensors,
with their exact lifetimes in the step, form the level-2 DSA problem. A local tensor's offset is its
block's level-2 offset plus its level-1 offset. The composition is valid by construction (a block
reserves its whole address range for its whole time span, and its local tensors never leave it)
and is checked against the full trace.

**What it costs.** A block holds its peak for the whole span of its segment, so a global tensor
allocated while the phase runs cannot use the room that the phase's early temporaries left free;
the plan's peak can therefore exceed the single-level optimum. ``stats`` reports the plan's peak
against the lower bound of the whole step (the most bytes ever live) so the cost is visible.

**Arena.** The buffers hf_memo owns carry a stable ``name`` in the trace. They are placed, by name,
in a separate small arena (their own DSA problem, with their lifetimes in the step); a name that
is allocated several times is one slot that lives from its first malloc to its last free and is as
large as its largest request. The runtime serves these buffers as views of one device buffer, held for
the whole step, and every other tensor from PyTorch's caching allocator. Both ways are replayed
(:mod:`~hf_memo.planner.caching_allocator`): when the arena would make the step reserve more device memory
than the caching allocator does alone (the arena's bytes stay taken where the allocator would have reused a
freed buffer's segment), the plan keeps its layout but marks it unused (``arena_used``), with a
:class:`~hf_memo.planner.dsa.PlannerWarning`, and the runtime leaves hf_memo's buffers to the allocator.
"""

from __future__ import annotations

import re
import time
import warnings
from collections import defaultdict

from tqdm.auto import tqdm

from hf_memo.planner.caching_allocator import replay, replay_with_arena
from hf_memo.planner.dsa import PlannerWarning, solve_dsa
from hf_memo.planner.lifetimes import Lifetime, Trace
from hf_memo.planner.plan import LayerBlock, MemoryPlan, Segment
from hf_memo.planner.solution import check_placement
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.units import format_bytes

LAYER_PHASE = re.compile(r"^layer (\d+) (forward|backward)$")


def _device_trace(trace: AllocationTrace) -> tuple[Trace, list[str]]:
    device = [e for e in trace.events if e.location == "device"]
    names = {e.tensor_id: e.name for e in device if e.op == "malloc" and e.name is not None}
    return Trace.from_events([(e.op, e.tensor_id, e.size) for e in device], names), [e.phase for e in device]


def plan_fingerprint(trace: AllocationTrace) -> str:
    """Fingerprint of a step's device events (ids renumbered): equal traces give equal plans."""
    return _device_trace(trace)[0].fingerprint()


def layer_segments(phases: list[str]) -> list[tuple[str, int, int]]:
    """``(phase, first_event, last_event)`` of every maximal run of one layer phase in ``phases``."""
    runs: list[tuple[str, int, int]] = []
    for index, phase in enumerate(phases):
        if not LAYER_PHASE.match(phase):
            continue
        if runs and runs[-1][0] == phase and runs[-1][2] == index - 1:
            runs[-1] = (phase, runs[-1][1], index)
        else:
            runs.append((phase, index, index))
    return runs


def _arena_slots(full: Trace) -> Trace:
    """One lifetime per owned-buffer name (id = position in ``sorted(names)``), see the module docstring."""
    spans: dict[str, list[int]] = {}
    for life in full.lifetimes:
        name = full.names.get(life.tensor_id)
        if name is None:
            continue
        span = spans.setdefault(name, [life.start, life.end, life.size])
        span[0], span[1], span[2] = min(span[0], life.start), max(span[1], life.end), max(span[2], life.size)
    slots = [Lifetime(k, spans[name][2], spans[name][0], spans[name][1]) for k, name in enumerate(sorted(spans))]
    return Trace(slots, full.length, {k: name for k, name in enumerate(sorted(spans))})


def plan_memory(
    trace: AllocationTrace,
    solver: str = "cpsat",
    time_limit: float = 10.0,
    alignment: int = 512,
    workers: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> MemoryPlan:
    """Make the bi-level plan of one training step's trace (see the module docstring).

    Args:
        trace: the profiler trace of one step, events tagged with their phase.
        solver: DSA solver of every level (see :func:`~hf_memo.planner.dsa.solve_dsa`).
        time_limit: seconds per DSA problem.
        alignment: bytes every size is rounded up to and every offset is a multiple of.
        workers, seed: solver threads and random seed.
        progress: show a progress bar over the problems.

    Returns:
        A :class:`MemoryPlan` whose offsets have been checked against every device tensor of ``trace``, with
        ``arena_used`` false when its arena would make the step reserve more than the caching allocator alone.
    """
    began = time.perf_counter()
    full, phases = _device_trace(trace)
    runs = layer_segments(phases)
    segment_of_event = [-1] * full.length
    for k, (_, first, last) in enumerate(runs):
        segment_of_event[first : last + 1] = [k] * (last - first + 1)
    local: list[list[Lifetime]] = [[] for _ in runs]
    global_lives: list[Lifetime] = []
    for life in full.lifetimes:
        k = segment_of_event[life.start]
        if k >= 0 and life.end <= runs[k][2]:
            local[k].append(life)
        else:
            global_lives.append(life)

    problems: dict[str, list[int]] = defaultdict(list)  # level-1 fingerprint -> segments sharing it
    sub_traces = {}
    for k, lives in enumerate(local):
        if lives:
            sub = Trace(lives, runs[k][2] + 1)
            sub_traces[k] = sub
            problems[sub.fingerprint()].append(k)

    options = dict(solver=solver, time_limit=time_limit, alignment=alignment, workers=workers, seed=seed)
    bar = tqdm(total=len(problems) + 2, desc="memory plan", unit="problem", disable=not progress)
    blocks: list[LayerBlock] = []
    block_of_segment: dict[int, int] = {}
    level1_stats = []
    for fingerprint, members in problems.items():
        bar.set_postfix_str(f"level 1: {runs[members[0]][0]}")
        sub = sub_traces[members[0]]
        solution = solve_dsa(sub, **options)
        blocks.append(
            LayerBlock(fingerprint, solution.peak, [solution.offsets[life.tensor_id] for life in sub.lifetimes])
        )
        level1_stats.append({"phases": [runs[k][0] for k in members], **solution.stats()})
        for k in members:
            block_of_segment[k] = len(blocks) - 1
        bar.update()

    bar.set_postfix_str("level 2")
    first_pseudo_id = max((life.tensor_id for life in full.lifetimes), default=0) + 1
    pseudo = {}
    for k, sub in sub_traces.items():
        tensor_id = first_pseudo_id + len(pseudo)
        span = (min(life.start for life in sub.lifetimes), max(life.end for life in sub.lifetimes))
        pseudo[k] = Lifetime(tensor_id, blocks[block_of_segment[k]].size, *span)
    level2 = solve_dsa(Trace(global_lives + list(pseudo.values()), full.length), **options)
    bar.update()

    bar.set_postfix_str("arena")
    slots = _arena_slots(full)
    arena = solve_dsa(slots, **options)
    bar.update()
    bar.close()

    segments = []
    for k, sub in sorted(sub_traces.items()):
        phase, first, last = runs[k]
        base = level2.offsets[pseudo[k].tensor_id]
        segments.append(
            Segment(phase, first, last, block_of_segment[k], base, [life.tensor_id for life in sub.lifetimes])
        )
    plan = MemoryPlan(
        fingerprint=full.fingerprint(),
        alignment=alignment,
        peak=0,
        lower_bound=full.lower_bound(alignment),
        blocks=blocks,
        segments=segments,
        global_offsets={life.tensor_id: level2.offsets[life.tensor_id] for life in global_lives},
        arena_size=arena.peak,
        arena_offsets={slots.names[k]: offset for k, offset in arena.offsets.items()},
        arena_sizes={slots.names[life.tensor_id]: life.size for life in slots.lifetimes},
        meta=dict(trace.meta),
    )
    plan.peak = check_placement(full, plan.offsets(), alignment)
    check_placement(slots, arena.offsets, alignment)
    reserved = replay(full).peak_reserved
    reserved_with_arena = replay_with_arena(full, arena.peak).peak_reserved
    if reserved_with_arena > reserved:
        plan.arena_used = False
        warnings.warn(
            f"memory planner: an arena for hf_memo's buffers ({format_bytes(arena.peak)}, held all step) would make "
            f"PyTorch's CUDA caching allocator (replayed) reserve {format_bytes(reserved_with_arena)} at peak, against "
            f"{format_bytes(reserved)} without it; the runtime leaves the buffers to the allocator",
            PlannerWarning,
            stacklevel=2,
        )
    plan.stats = {
        "seconds": round(time.perf_counter() - began, 4),
        "tensors": len(full),
        "local_tensors": sum(len(lives) for lives in local),
        "segments": len(runs),
        "level1": level1_stats,
        "level2": {**level2.stats(), "pseudo_blocks": len(pseudo)},
        "arena": arena.stats(),
        "allocator": {"reserved": reserved, "reserved_with_arena": reserved_with_arena},
    }
    return plan
