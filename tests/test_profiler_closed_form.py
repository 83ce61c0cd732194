import pytest

from hf_memo.profiler.closed_form import ClosedForm, StepSize, moment_peaks
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace


def _trace(tokens: int, chunk: int, layers: int = 2) -> AllocationTrace:
    """A toy step: each layer keeps ``tokens`` bytes; its backward has a chunk transient (2 * chunk) after an
    attention-like transient (tokens); one op name for both, told apart by the op before it."""
    events, next_id = [], 0

    def malloc(size, phase, source):
        nonlocal next_id
        next_id += 1
        events.append(AllocationEvent("malloc", next_id, size, phase, "activation", source=source))
        return next_id

    def free(tensor_id, size, phase):
        events.append(AllocationEvent("free", tensor_id, size, phase, "activation"))

    kept = [malloc(tokens, f"layer {i} forward", "a > mm") for i in range(layers)]
    for i in reversed(range(layers)):
        phase = f"layer {i} backward"
        attention = malloc(tokens, phase, "sdpa > mul")
        free(attention, tokens, phase)
        for _ in range(max(1, tokens // chunk)):
            transient = malloc(2 * chunk, phase, "silu > mul")
            free(transient, 2 * chunk, phase)
        free(kept[i], tokens, phase)
    return AllocationTrace(events, {"layers": layers})


def test_moments_of_one_op_are_told_apart_by_the_op_before_it():
    peaks = moment_peaks(_trace(100, 50))
    assert peaks[("layer last backward", 0, "sdpa > mul")].total == 300
    assert peaks[("layer last backward", 0, "silu > mul")].total == 300


def test_the_peak_switches_moments_where_one_line_would_not():
    sizes = ((100, 50, 10), (200, 100, 10), (200, 50, 10), (300, 150, 20))  # tokens, MLP rows, head rows
    samples = [(StepSize(2, t, c, h, layer_terms=False), _trace(t, c)) for t, c, h in sizes]
    form = ClosedForm(samples)
    # long chunks: the chunk transient peaks (2 kept + 2 * chunk); short ones: attention's (3 * tokens)
    assert form.peak(StepSize(2, 1000, 900, 900, False)).total == 2000 + 1800
    assert form.peak(StepSize(2, 1000, 10, 10, False)).total == 3000
    with pytest.raises(ValueError, match="need 4 profiles with independent sizes"):
        ClosedForm(samples[:3])
