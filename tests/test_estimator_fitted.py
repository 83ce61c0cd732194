"""The closed form against direct fake-tensor profiles of the same setup, each in a fresh model (Llama-3-8B)."""

import pytest
import torch

from hf_memo.estimator.fitted import FittedFootprint, chunk_rows
from hf_memo.estimator.setups import AUTO_CHUNKS, MODES, memo_with_offload
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.shapes import builtin_config

CONFIG = builtin_config("llama-3-8b")


def _profiler_for(mode):
    spec = MODES[mode]

    def profiler_for(chunks):
        configure = (
            memo_with_offload(0.0, chunks)
            if mode == "memo"
            else (lambda model: spec.configure_chunked(model, None, chunks))
        )
        return StepProfiler(
            CONFIG,
            lambda model, _s: (configure(model), model)[1],
            torch.bfloat16,
            profile_layers=spec.profile_layers,
            fresh=True,
        )

    return profiler_for


def test_chunk_rows_follow_the_runtime_rule():
    # LM head: 128256 / 4096 -> 32 chunks up to 2^26 / 128256 = 523 rows each, then more (never under 1,024 rows);
    # MLP: 14336 / 4096 -> 4 chunks up to 2^26 / 14336 = 4681 rows each, then more (a divisor if one is near)
    assert chunk_rows(CONFIG, "tokens", 1, 16384) == (4096, 1024)  # 32 head chunks would be under 1,024 tokens
    assert chunk_rows(CONFIG, "tokens", 1, 131072) == (4096, 1024)
    assert chunk_rows(CONFIG, "memo", 2, 131072)[0] == 2 * 131072 // 64  # per sequence, 2^25 elements per row
    assert chunk_rows(CONFIG, "tokens", 1, 1024) == (1024, 1024)  # short: one chunk


@pytest.mark.parametrize(
    "mode,lengths",
    # memo: one length just past a bucket boundary, the hardest case (host buffers 3.1% longer than the step); whole
    # buckets, as long as their steps, are checked against direct profiles in test_estimator_policy_footprint.py
    # full and selective (hf_memo's own recompute): one length each, past the shortest chunk rows
    [("minseq", (16384, 65536, 262144)), ("memo", (65537,)), ("full", (65536,)), ("selective", (65536,))],
)
def test_the_closed_form_is_within_one_percent_of_direct_profiles(mode, lengths):
    profiler_for = _profiler_for(mode)
    fitted = FittedFootprint(profiler_for, MODES[mode].chunking)
    for seq_len in lengths:  # each in the regime of its own chunk counts (4 to 64 MLP chunks, 16 to 256 head chunks)
        direct = profiler_for(AUTO_CHUNKS).footprint(seq_len)
        fast = fitted.footprint(seq_len)
        assert fast.device.total == pytest.approx(direct.device.total, rel=0.01), seq_len
        assert fast.host.total == pytest.approx(direct.host.total, rel=0.01, abs=1), seq_len
