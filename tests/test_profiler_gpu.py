import pytest
import torch

from hf_memo.profiler.allocations import StorageTag
from hf_memo.profiler.analysis import peak, unfreed
from hf_memo.profiler.gpu import (
    allocated_blocks,
    cuda_training_step_trace,
    layer_forward_seconds,
    offload_inputs,
    pinned_bandwidth,
    trace_from_snapshot,
)


def _entry(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": []}


# The layout torch.cuda.memory._snapshot() returns (see its TraceEntry / Segment docs).
SNAPSHOT = {
    "segments": [
        {
            "device": 0,
            "address": 0x1000,
            "total_size": 4096,
            "blocks": [
                {"address": 0x1000, "size": 1024, "requested_size": 1000, "state": "active_allocated"},
                {"address": 0x1400, "size": 3072, "requested_size": 0, "state": "inactive"},
            ],
        },
        {
            "device": 1,
            "address": 0x9000,
            "total_size": 512,
            "blocks": [{"address": 0x9000, "size": 512, "state": "active_allocated"}],
        },
    ],
    "device_traces": [
        [
            _entry("segment_alloc", 0x2000, 8192),
            _entry("alloc", 0x2000, 512),  # recorder saw it: an activation of layer 0's forward
            _entry("alloc", 0x2200, 256),  # kernel workspace the recorder cannot see
            _entry("free_requested", 0x2200, 256),
            _entry("free_completed", 0x2200, 256),
            _entry("alloc", 0x2200, 128),  # the address is reused: a new tensor
            _entry("free_requested", 0x3000, 64),  # allocated before recording, unknown
            _entry("free_requested", 0x2000, 512),
            _entry("free_completed", 0x2000, 512),
            _entry("free_requested", 0x1000, 1000),
            _entry("snapshot", 0, 0),
        ],
        [],
    ],
}
TAGS = [
    StorageTag(0x1000, 1000, "other", "parameter", "device", None),
    StorageTag(0x2000, 512, "layer 0 forward", "activation", "device", None),
    StorageTag(0x2200, 128, "layer 0 backward", "temporary", "host", "swap 0"),
]


def test_snapshot_blocks_allocated_at_snapshot_time():
    assert allocated_blocks(SNAPSHOT, 0) == [(0x1000, 1000)]
    assert allocated_blocks(SNAPSHOT, 1) == [(0x9000, 512)]


def test_alloc_and_free_requests_pair_by_address_into_tagged_events():
    trace = trace_from_snapshot(SNAPSHOT, 0, TAGS, allocated_blocks(SNAPSHOT, 0), {"model": "tiny"})
    assert [(e.op, e.tensor_id, e.size, e.phase, e.category, e.location, e.name) for e in trace.events] == [
        ("malloc", 0, 1000, "other", "parameter", "device", None),
        ("malloc", 1, 512, "layer 0 forward", "activation", "device", None),
        ("malloc", 2, 256, "layer 0 forward", "temporary", "device", None),
        ("free", 2, 256, "layer 0 forward", "temporary", "device", None),
        ("malloc", 3, 128, "layer 0 backward", "temporary", "host", "swap 0"),
        ("free", 1, 512, "layer 0 backward", "activation", "device", None),
        ("free", 0, 1000, "layer 0 backward", "parameter", "device", None),
    ]
    assert trace.meta == {"model": "tiny", "live_at_end": [3], "unmatched_frees": 1}
    assert unfreed(trace) == [3]
    assert peak(trace).total == 1000 + 512 + 256


def test_without_free_requests_the_completed_frees_pair_instead():
    entries = [e for e in SNAPSHOT["device_traces"][0] if e["action"] != "free_requested"]
    trace = trace_from_snapshot({"device_traces": [entries]})
    assert [(e.op, e.tensor_id) for e in trace.events] == [
        ("malloc", 0),
        ("malloc", 1),
        ("free", 1),
        ("malloc", 2),
        ("free", 0),
    ]
    assert all(e.category == "temporary" for e in trace.events)


def test_a_second_alloc_at_a_live_address_is_an_error():
    entries = [_entry("alloc", 0x10, 8), _entry("alloc", 0x10, 8)]
    with pytest.raises(ValueError, match="entry 1"):
        trace_from_snapshot({"device_traces": [entries]})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_gpu_only_functions_say_they_need_a_gpu():
    model = torch.nn.Linear(2, 2)
    for call in (
        lambda: cuda_training_step_trace(model, 1, 8),
        lambda: layer_forward_seconds(model, 8),
        lambda: pinned_bandwidth(),
        lambda: offload_inputs(model, 8),
    ):
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            call()
