import pytest

from hf_memo.profiler.analysis import peak
from hf_memo.profiler.extrapolate import extrapolated_peak, slot_peaks
from hf_memo.profiler.step import trace_training_step
from tests.test_profiler_step import build


def _trace(layers, mode, lora=False, optimizer="adamw", seq_len=1024, family="llama"):
    model, session = build(family, mode, lora=lora, layers=layers)
    with session:
        return trace_training_step(model, 1, seq_len, optimizer)


@pytest.mark.parametrize(
    "family,mode,lora,optimizer",
    [
        ("llama", "vanilla", False, "adamw"),
        ("llama", "checkpointing", False, "none"),
        ("llama", "minseq", False, "adamw"),
        ("llama", "vanilla", True, "adamw"),
        ("llama", "minseq", True, "none"),
        ("gpt2", "minseq", False, "adamw"),
    ],
)
def test_two_and_three_layers_extrapolate_to_the_full_profile_within_two_percent(family, mode, lora, optimizer):
    full = peak(_trace(7, mode, lora, optimizer, family=family))
    shallow, deeper = _trace(2, mode, lora, optimizer, family=family), _trace(3, mode, lora, optimizer, family=family)
    estimate = extrapolated_peak(shallow, deeper, 7)
    assert abs(estimate.total - full.total) <= 0.02 * full.total
    assert estimate.total == full.total  # exact, in fact: identical layers make every phase linear in depth
    assert estimate.by_category == full.by_category
    assert estimate.phase == full.phase


def test_slots_cover_the_end_layers_and_the_rest():
    slots = slot_peaks(_trace(3, "vanilla", seq_len=256))
    assert sorted(slots) == sorted(
        [
            ("other", 0),
            ("embedding", 0),
            ("layer first forward", 0),
            ("layer last forward", 0),
            ("head", 0),
            ("layer last backward", 0),
            ("layer first backward", 0),
            ("embedding", 1),
            ("optimizer", 0),
        ]
    )


def test_extrapolation_refuses_unusable_profiles():
    two, three = _trace(2, "vanilla", seq_len=256), _trace(3, "vanilla", seq_len=256)
    with pytest.raises(ValueError, match="2 <= a < b"):
        extrapolated_peak(three, two, 8)
    other = _trace(3, "vanilla", optimizer="none", seq_len=256)
    with pytest.raises(ValueError, match="same phases"):
        extrapolated_peak(two, other, 8)
