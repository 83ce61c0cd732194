import pytest

from hf_memo.profiler.closed_form import ClosedForm, StepSize, moment_peaks
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace


def _trace(tokens: int, chunk: int, layers: int = 2, stretch: float = 1.0) -> AllocationTrace:
    """A toy step: each layer keeps ``tokens`` bytes (in a buffer ``stretch`` times that, named ``"bucket"``); its
    backward has a chunk transient (2 * chunk) after an attention-like transient (tokens); one op name for both,
    told apart by the op before it."""
    events, next_id = [], 0

    def malloc(size, phase, source, name=None):
        nonlocal next_id
        next_id += 1
        events.append(AllocationEvent("malloc", next_id, size, phase, "activation", name=name, source=source))
        return next_id

    def free(tensor_id, size, phase):
        events.append(AllocationEvent("free", tensor_id, size, phase, "activation"))

    kept_bytes = round(tokens * stretch)
    kept = [malloc(kept_bytes, f"layer {i} forward", "a > mm", "bucket") for i in range(layers)]
    for i in reversed(range(layers)):
        phase = f"layer {i} backward"
        attention = malloc(tokens, phase, "sdpa > mul")
        free(attention, tokens, phase)
        for _ in range(max(1, tokens // chunk)):
            transient = malloc(2 * chunk, phase, "silu > mul")
            free(transient, 2 * chunk, phase)
        free(kept[i], kept_bytes, phase)
    return AllocationTrace(events, {"layers": layers})


def test_moments_of_one_op_are_told_apart_by_the_op_before_it():
    peaks = moment_peaks(_trace(100, 50))
    assert peaks[("layer last backward", 0, "sdpa > mul")][0].total == 300
    assert peaks[("layer last backward", 0, "silu > mul")][0].total == 300


def test_the_peak_switches_moments_where_one_line_would_not():
    sizes = ((100, 50, 10), (200, 100, 10), (200, 50, 10), (300, 150, 20))  # tokens, MLP rows, head rows
    samples = [(StepSize(2, t, c, h, layer_terms=False), _trace(t, c)) for t, c, h in sizes]
    form = ClosedForm(samples)
    # long chunks: the chunk transient peaks (2 kept + 2 * chunk); short ones: attention's (3 * tokens)
    assert form.peak(StepSize(2, 1000, 900, 900, False)).total == 2000 + 1800
    assert form.peak(StepSize(2, 1000, 10, 10, False)).total == 3000
    with pytest.raises(ValueError, match="need 4 profiles with independent sizes"):
        ClosedForm(samples[:3])


def test_buffers_sized_for_the_length_bucket_scale_with_the_stretch_asked_about():
    sizes = ((100, 50, 10, 1.0), (200, 100, 10, 1.25), (200, 50, 10, 1.0), (300, 150, 20, 1.1))  # + the stretch
    samples = [(StepSize(2, t, c, h, False, stretch), _trace(t, c, stretch=stretch)) for t, c, h, stretch in sizes]
    in_bucket = lambda event: event.name == "bucket"  # noqa: E731
    form = ClosedForm(samples, bucketed=in_bucket)
    sized = moment_peaks(samples[1][1], bucketed=in_bucket)[("layer last backward", 0, "sdpa > mul")][1]
    assert sized["activation"] == 2 * 250  # both layers' kept buffers, 1.25 x 200 bytes each
    # long chunks: 2 kept buffers (1.5 x 1000 each) + the chunk transient; short ones: + attention's 1000
    assert form.peak(StepSize(2, 1000, 900, 900, False, 1.5)).total == 3000 + 1800
    assert form.peak(StepSize(2, 1000, 10, 10, False, 1.5)).total == 3000 + 1000
    assert form.peak(StepSize(2, 1000, 10, 10, False)).total == 2000 + 1000
    blind = ClosedForm(samples)  # the same profiles, not told which buffers are stretched: off
    assert blind.peak(StepSize(2, 1000, 10, 10, False, 1.5)).total != 3000 + 1000
