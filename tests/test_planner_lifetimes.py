import pytest

from hf_memo.planner.lifetimes import Lifetime, Trace
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace


def test_lifetimes_are_half_open_event_intervals_and_unfreed_tensors_live_to_the_end():
    trace = Trace.from_events(
        [("malloc", 7, 100), ("malloc", 3, 50), ("free", 7, 100), ("malloc", 9, 20), ("free", 9, 20)]
    )
    assert trace.lifetimes == (Lifetime(7, 100, 0, 2), Lifetime(3, 50, 1, 5), Lifetime(9, 20, 3, 4))
    assert trace.length == 5 and len(trace) == 3
    # Tensor 7 is gone at event 2 (its free), so 9 (event 3) never meets it: 150 live at most.
    assert trace.live_bytes() == [100, 150, 50, 70, 50]
    assert trace.lower_bound() == 150
    assert trace.lower_bound(alignment=512) == 1024


def test_events_reconstruct_the_trace():
    events = [("malloc", 1, 10), ("malloc", 2, 30), ("free", 1, 10), ("malloc", 4, 5)]
    assert Trace.from_events(events).events() == events


@pytest.mark.parametrize(
    "events,message",
    [
        ([("malloc", 1, 8), ("free", 2, 8)], r"event 1 \('free', 2, 8\): free before malloc of tensor 2"),
        (
            [("malloc", 1, 8), ("free", 1, 8), ("free", 1, 8)],
            r"event 2 \('free', 1, 8\): double free of tensor 1 \(first freed at event 1\)",
        ),
        (
            [("malloc", 1, 8), ("free", 1, 16)],
            r"event 1 \('free', 1, 16\): size mismatch, tensor 1 was allocated with 8 bytes, freed with 16",
        ),
        ([("malloc", 1, -4)], r"event 0 \('malloc', 1, -4\): size must be an int > 0 bytes, got -4"),
        ([("malloc", 1, 8), ("malloc", 2, 0)], r"event 1 \('malloc', 2, 0\): size must be an int > 0 bytes, got 0"),
        ([("malloc", 1, 2.5)], r"event 0 \('malloc', 1, 2.5\): size must be an int > 0 bytes"),
        ([("alloc", 1, 8)], r"""event 0 \('alloc', 1, 8\): op must be "malloc" or "free", got 'alloc'"""),
        (
            [("malloc", 1, 8), ("malloc", 1, 8)],
            r"event 1 .*: malloc of tensor 1, which was allocated before \(still live\)",
        ),
        ([("malloc", 1, 8), ("free", 1, 8), ("malloc", 1, 8)], r"event 2 .*allocated before \(freed\)"),
        ([("malloc", 1)], r"event 0 \('malloc', 1\): an event is \(op, tensor_id, bytes\)"),
    ],
)
def test_malformed_traces_name_the_event(events, message):
    with pytest.raises(ValueError, match=message):
        Trace.from_events(events)


def test_bad_lifetimes_are_rejected():
    with pytest.raises(ValueError, match=r"tensor 1 lives over \[3, 3\)"):
        Trace([Lifetime(1, 8, 3, 3)], 5)
    with pytest.raises(ValueError, match="ids must be unique"):
        Trace([Lifetime(1, 8, 0, 1), Lifetime(1, 8, 1, 2)], 2)


def test_from_profiler_trace_keeps_device_events_and_owned_names(tmp_path):
    allocations = AllocationTrace(
        [
            AllocationEvent("malloc", 1, 512, "layer 0 forward", "activation", name="layer 0 rounding 0"),
            AllocationEvent("malloc", 2, 64, "layer 0 forward", "temporary", "host"),
            AllocationEvent("malloc", 3, 256, "layer 0 forward"),
            AllocationEvent("free", 3, 256, "layer 0 forward"),
            AllocationEvent("free", 2, 64, "layer 0 forward", "temporary", "host"),
            AllocationEvent("free", 1, 512, "layer 0 backward", "activation"),
        ]
    )
    trace = Trace.from_allocations(allocations)
    assert [life.tensor_id for life in trace.lifetimes] == [1, 3] and trace.length == 4
    assert trace.names == {1: "layer 0 rounding 0"}
    assert len(Trace.from_allocations(allocations, location=None)) == 3
    path = tmp_path / "step.jsonl"
    allocations.save(path)
    assert Trace.load(path).lifetimes == trace.lifetimes


def test_fingerprint_ignores_ids_but_sees_order_and_sizes():
    base = Trace.from_events([("malloc", 1, 8), ("malloc", 2, 4), ("free", 1, 8), ("free", 2, 4)])
    renumbered = Trace.from_events([("malloc", 40, 8), ("malloc", 17, 4), ("free", 40, 8), ("free", 17, 4)])
    other_size = Trace.from_events([("malloc", 1, 16), ("malloc", 2, 4), ("free", 1, 16), ("free", 2, 4)])
    other_order = Trace.from_events([("malloc", 1, 8), ("malloc", 2, 4), ("free", 2, 4), ("free", 1, 8)])
    assert base.fingerprint() == renumbered.fingerprint()
    assert len({base.fingerprint(), other_size.fingerprint(), other_order.fingerprint()}) == 3
