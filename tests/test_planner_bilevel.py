import json

import pytest

from hf_memo.planner.bilevel import layer_segments, plan_fingerprint, plan_memory
from hf_memo.planner.dsa import PlannerWarning
from hf_memo.planner.lifetimes import Lifetime, Trace
from hf_memo.planner.plan import MemoryPlan
from hf_memo.planner.solution import check_placement
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace

KiB = 1024


class StepBuilder:
    """Writes the trace of a hand-made training step: ``malloc`` returns a new id, ``free`` releases one."""

    def __init__(self) -> None:
        self.events: list[AllocationEvent] = []
        self.sizes: dict[int, int] = {}
        self.locations: dict[int, str] = {}
        self.phase = "other"

    def malloc(self, size: int, name: str | None = None, location: str = "device") -> int:
        tensor_id = len(self.sizes)
        self.sizes[tensor_id], self.locations[tensor_id] = size, location
        self.events.append(AllocationEvent("malloc", tensor_id, size, self.phase, location=location, name=name))
        return tensor_id

    def free(self, *tensor_ids: int) -> None:
        for tensor_id in tensor_ids:
            size, location = self.sizes[tensor_id], self.locations[tensor_id]
            self.events.append(AllocationEvent("free", tensor_id, size, self.phase, location=location))

    def trace(self, **meta) -> AllocationTrace:
        return AllocationTrace(self.events, meta)


def decoder_step(layers: int = 4, seq: int = 8, odd_last_layer: bool = False) -> AllocationTrace:
    """Embedding, ``layers`` decoder layers (forward: temporaries, saved activations, an owned rounding
    buffer, a host copy; backward: temporaries, an owned prefetch buffer reused by every layer), a head
    and an optimizer phase. Sizes scale with ``seq``."""
    step = StepBuilder()
    unit = seq * KiB
    step.phase = "other"
    params = [step.malloc(64 * KiB) for _ in range(layers)]
    step.phase = "embedding"
    hidden = step.malloc(2 * unit)
    saved = []
    for i in range(layers):
        step.phase = f"layer {i} forward"
        scale = 2 if odd_last_layer and i == layers - 1 else 1
        norm = step.malloc(2 * unit)
        rounding = step.malloc(unit, name=f"layer {i} rounding 0")
        up = step.malloc(6 * unit * scale)
        act = step.malloc(6 * unit * scale)
        step.free(up)
        host = step.malloc(2 * unit, location="host")
        out = step.malloc(2 * unit)
        step.free(rounding, norm)
        saved.append((hidden, act, host))
        hidden = out
    step.phase = "head"
    logits = step.malloc(16 * unit)
    grad = step.malloc(2 * unit)
    step.free(logits)
    grads = []
    for i in reversed(range(layers)):
        step.phase = f"layer {i} backward"
        layer_input, act, host = saved[i]
        prefetch = step.malloc(2 * unit, name="prefetch")
        d_act = step.malloc(6 * unit)
        step.free(act, host)
        d_norm = step.malloc(2 * unit)
        grads.append(step.malloc(64 * KiB))
        step.free(d_act, prefetch)
        d_in = step.malloc(2 * unit)
        step.free(d_norm, grad, layer_input)
        grad = d_in
    step.phase = "optimizer"
    for g in grads:
        scratch = step.malloc(64 * KiB)
        step.free(scratch, g)
    step.free(grad)
    del params
    return step.trace(model="hand-made", seq_len=seq)


def test_segments_are_runs_of_one_layer_phase():
    phases = ["embedding", "layer 0 forward", "layer 0 forward", "layer 1 forward", "head", "layer 0 forward"]
    assert layer_segments(phases) == [("layer 0 forward", 1, 2), ("layer 1 forward", 3, 3), ("layer 0 forward", 5, 5)]


def test_bilevel_plan_is_valid_end_to_end_and_identical_layers_share_their_level_one_solution():
    trace = decoder_step(layers=4)
    plan = plan_memory(trace, progress=False)
    device = Trace.from_allocations(trace)
    assert check_placement(device, plan.offsets(), alignment=512) == plan.peak
    assert plan.peak >= plan.lower_bound == device.lower_bound(512)
    assert len(plan.offsets()) == len(device)
    assert len(plan.segments) == 8 and len(plan.blocks) == 2
    assert {s.phase for s in plan.segments} == {f"layer {i} {d}" for i in range(4) for d in ("forward", "backward")}
    assert plan.stats["level1"][0]["phases"] == [f"layer {i} forward" for i in range(4)]
    # Local tensors stay inside their block; global tensors are planned at level 2.
    for segment in plan.segments:
        block = plan.blocks[segment.block]
        assert all(0 <= offset < block.size for offset in block.offsets)
        assert not set(segment.tensor_ids) & set(plan.global_offsets)
    assert plan.fingerprint == plan_fingerprint(trace) == device.fingerprint()
    assert plan.meta == {"model": "hand-made", "seq_len": 8}


def test_owned_buffers_get_one_arena_slot_per_name_that_never_overlaps_a_live_one():
    trace = decoder_step(layers=3)
    plan = plan_memory(trace, progress=False)
    assert set(plan.arena_offsets) == {"layer 0 rounding 0", "layer 1 rounding 0", "layer 2 rounding 0", "prefetch"}
    assert plan.arena_sizes["prefetch"] == 16 * KiB
    # "prefetch" is allocated in every layer's backward: one slot from its first malloc to its last free.
    device = Trace.from_allocations(trace)
    spans = {}
    for life in device.lifetimes:
        name = device.names.get(life.tensor_id)
        if name is not None:
            first, last, size = spans.get(name, (life.start, life.end, life.size))
            spans[name] = (min(first, life.start), max(last, life.end), max(size, life.size))
    slots = Trace([Lifetime(k, size, a, b) for k, (a, b, size) in enumerate(spans.values())], device.length)
    offsets = {k: plan.arena_offsets[name] for k, name in enumerate(spans)}
    assert check_placement(slots, offsets, alignment=512) == plan.arena_size
    # The three rounding buffers live in three different forward phases: they share memory.
    assert len({plan.arena_offsets[f"layer {i} rounding 0"] for i in range(3)}) == 1


def test_a_different_layer_gets_its_own_level_one_solution():
    trace = decoder_step(layers=4, odd_last_layer=True)
    plan = plan_memory(trace, progress=False)
    forward_blocks = {s.block for s in plan.segments if s.phase.endswith("forward")}
    assert len(forward_blocks) == 2 and len(plan.blocks) == 3
    check_placement(Trace.from_allocations(trace), plan.offsets(), alignment=512)


def test_other_shapes_change_the_fingerprint():
    assert plan_fingerprint(decoder_step(seq=8)) != plan_fingerprint(decoder_step(seq=16))


def test_a_trace_without_layer_phases_is_planned_in_one_level():
    step = StepBuilder()
    a, b = step.malloc(1000), step.malloc(3000)
    step.free(a)
    c = step.malloc(500)
    step.free(b, c)
    plan = plan_memory(step.trace(), progress=False)
    assert plan.segments == [] and plan.blocks == []
    assert plan.peak == plan.lower_bound == 3072 + 1024


def test_plan_round_trips_through_json_and_summarises(tmp_path, capsys):
    plan = plan_memory(decoder_step(layers=2), progress=True)
    assert "memory plan" in capsys.readouterr().err  # the progress bar
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = MemoryPlan.load(path)
    assert loaded == plan and loaded.offsets() == plan.offsets()
    summary = plan.summary()
    assert f"plan {plan.fingerprint}" in summary and "level 1 layer 0 forward (+1 identical)" in summary
    assert "level 2:" in summary and "arena:" in summary


def test_loading_something_else_is_a_clear_error(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "hf_memo-trace", "version": 1}))
    with pytest.raises(ValueError, match="not an hf_memo plan of version 1"):
        MemoryPlan.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="plan.json: not an hf_memo plan"):
        MemoryPlan.load(path)


def test_an_arena_the_caching_allocator_would_beat_is_kept_but_not_used():
    """A 40 MiB owned buffer freed before a 40 MiB peak: the allocator reuses its segment, an arena holds it."""
    MiB = 2**20
    step = StepBuilder()
    weights = step.malloc(12 * MiB)
    buffer = step.malloc(40 * MiB, name="rounding 0")
    step.free(buffer)
    logits = step.malloc(40 * MiB)
    step.free(logits, weights)
    with pytest.warns(
        PlannerWarning,
        match=r"\(40.00 MiB, held all step\) would make PyTorch's CUDA caching allocator \(replayed\) reserve 92",
    ):
        plan = plan_memory(step.trace(), progress=False)
    assert plan.stats["allocator"] == {"reserved": 52 * MiB, "reserved_with_arena": 92 * MiB}
    assert not plan.arena_used and plan.arena_offsets == {"rounding 0": 0}  # the layout stays, for the record
    assert "(1 buffers, not used)" in plan.summary() and "not used: the caching allocator alone reserves less" in (
        plan.summary()
    )
    assert MemoryPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan

    step = StepBuilder()  # the buffer alive at the peak: the arena costs nothing more
    weights = step.malloc(12 * MiB)
    buffer = step.malloc(40 * MiB, name="rounding 0")
    logits = step.malloc(40 * MiB)
    step.free(logits, buffer, weights)
    plan = plan_memory(step.trace(), progress=False)
    assert plan.arena_used and plan.stats["allocator"]["reserved_with_arena"] <= plan.stats["allocator"]["reserved"]
