import pytest

from hf_memo.profiler.analysis import (
    canonical,
    check_identical_layers,
    differing_layers,
    layer_trace,
    live_bytes,
    peak,
    unfreed,
)
from hf_memo.profiler.step import trace_training_step
from hf_memo.profiler.trace import CATEGORIES, AllocationEvent, AllocationTrace
from tests.test_profiler_step import build


def _layer(layer, first_id, sizes=(100, 10)):
    """Layer ``layer``: allocates an activation and a temporary in forward, frees both by its backward's end."""
    act, tmp = first_id, first_id + 1
    fwd, bwd = f"layer {layer} forward", f"layer {layer} backward"
    return [
        AllocationEvent("malloc", act, sizes[0], fwd, "activation"),
        AllocationEvent("malloc", tmp, sizes[1], fwd, "temporary"),
        AllocationEvent("free", tmp, sizes[1], fwd, "temporary"),
    ], [AllocationEvent("free", act, sizes[0], bwd, "activation")]


def _trace(layer_sizes):
    forward, backward = [], []
    for layer, sizes in enumerate(layer_sizes):
        f, b = _layer(layer, 10 * layer, sizes)
        forward += f
        backward = b + backward
    weights = [AllocationEvent("malloc", 99, 1000, "other", "parameter")]
    host = [AllocationEvent("malloc", 98, 7, "head", "activation", "host")]
    return AllocationTrace(weights + forward + host + backward, {"layers": len(layer_sizes)})


def test_live_bytes_and_peak_with_its_breakdown_per_location():
    trace = _trace([(100, 10), (100, 10)])
    assert live_bytes(trace)[:4] == [1000, 1100, 1110, 1100]
    top = peak(trace)
    assert (top.total, top.phase) == (1210, "layer 1 forward")
    assert top.by_category == {
        "parameter": 1000,
        "buffer": 0,
        "gradient": 0,
        "optimizer": 0,
        "activation": 200,
        "temporary": 10,
    }
    assert peak(trace, "host").total == 7
    assert unfreed(trace) == [98, 99]


def test_layer_traces_and_the_identity_check():
    same = _trace([(100, 10)] * 3)
    assert differing_layers(same) == []
    check_identical_layers(same)
    assert canonical(layer_trace(same, 2, "forward").events) == canonical(layer_trace(same, 0, "forward").events)
    odd = _trace([(100, 10), (100, 12), (100, 10)])
    assert differing_layers(odd) == ["layer 1 forward"]
    with pytest.raises(ValueError, match="layer 1 forward"):
        check_identical_layers(odd)
    with pytest.raises(ValueError, match="direction"):
        layer_trace(same, 0, "sideways")


def test_own_layer_traces_leave_out_frees_of_tensors_made_elsewhere():
    events = [
        AllocationEvent("malloc", 1, 8, "embedding", "activation"),
        AllocationEvent("malloc", 2, 4, "layer 0 forward", "activation"),
        AllocationEvent("free", 1, 8, "layer 0 backward", "activation"),
        AllocationEvent("free", 2, 4, "layer 0 backward", "activation"),
    ]
    trace = AllocationTrace(events, {"layers": 1})
    assert [e.tensor_id for e in layer_trace(trace, 0, "backward").events] == [1, 2]
    assert [e.tensor_id for e in layer_trace(trace, 0, "backward", own=True).events] == [2]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("mode", ["vanilla", "checkpointing", "minseq"])
def test_identical_decoder_layers_give_identical_traces(mode, lora):
    model, session = build("llama", mode, lora=lora, layers=4)
    with session:
        trace = trace_training_step(model, 1, 512)
    different = differing_layers(trace)
    if lora and mode == "vanilla":
        # With frozen embeddings layer 0's input needs no gradient, so layer 0 saves less: it really differs.
        assert different == ["layer 0 forward", "layer 0 backward"]
    else:
        assert different == []
        check_identical_layers(trace)
    for direction in ("forward", "backward"):
        assert canonical(layer_trace(trace, 1, direction).events) == canonical(layer_trace(trace, 2, direction).events)


def test_peak_chooses_the_highest_moment_by_the_restated_bytes():
    """With ``restate`` (e.g. a DeepSpeed rank's states in place of the profile's) the forward moment may be the
    highest though the profile's own bytes peak in backward."""
    events = [
        AllocationEvent("malloc", 0, 10, "layer 0 forward", "parameter"),
        AllocationEvent("malloc", 1, 50, "layer 0 forward", "activation"),
        AllocationEvent("free", 1, 50, "layer 0 backward", "activation"),
        AllocationEvent("malloc", 2, 30, "layer 0 backward", "gradient"),
        AllocationEvent("malloc", 3, 25, "layer 0 backward", "temporary"),
    ]
    trace = AllocationTrace(events)
    gradient = CATEGORIES.index("gradient")

    def shrink_gradients(values):
        values = values.copy()
        values[:, gradient] = values[:, gradient] // 6
        return values

    assert peak(trace).total == 65 and peak(trace).phase == "layer 0 backward"
    restated = peak(trace, restate=shrink_gradients)
    assert restated.total == 60 and restated.phase == "layer 0 forward" and restated.by_category["activation"] == 50
