import torch

import hf_memo
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.footprint import StepProfiler, with_layers
from tests.test_profiler_step import CONFIGS


def _minseq(model, session):
    hf_memo.apply(model, min_chunk_tokens=128)
    return model


def test_deep_models_are_extrapolated_shallow_ones_profiled_whole_and_models_are_reused():
    calls = []
    profiler = StepProfiler(CONFIGS["llama"](6), _minseq, torch.bfloat16, on_profile=lambda *a: calls.append(a))
    footprint = profiler.footprint(1024)
    assert calls == [(2, 1024), (3, 1024)]
    assert "extrapolated linearly" in footprint.method
    full = peak(profiler.trace(1024))
    assert calls[-1] == (6, 1024)
    assert footprint.device == type(footprint.device)(full.total, full.by_category, -1, full.phase)
    profiler.footprint(2048)
    assert len(profiler._models) == 3  # one fake model per depth, reused across lengths

    shallow = StepProfiler(CONFIGS["llama"](3), _minseq, torch.bfloat16)
    assert shallow.footprint(512).method == "profiled all 3 layers on fake tensors"
    assert shallow.footprint(512).host.total == 0


def test_with_layers_copies_the_config():
    config = CONFIGS["gpt2"](4)
    assert with_layers(config, 2).num_hidden_layers == 2
    assert config.num_hidden_layers == 4


def _memo(model, session):
    hf_memo.apply(model, recompute="memo", offload_fraction=0.0, host_memory_limit=2**40, min_chunk_tokens=128)
    return model


def test_fresh_profiles_do_not_depend_on_what_was_profiled_before():
    """A reused memo runtime hands a shorter step the host buffers of a longer one; a fresh model per profile
    starts from an empty host pool, so the shorter step's profile is the same whatever ran before it."""
    config = CONFIGS["llama"](5)
    alone = StepProfiler(config, _memo, torch.bfloat16, fresh=True).trace(1792, 5)
    fresh, reused = (StepProfiler(config, _memo, torch.bfloat16, fresh=f) for f in (True, False))
    for profiler in (fresh, reused):
        profiler.trace(2048, 5)  # a longer step first
    after_fresh, after_reused = fresh.trace(1792, 5), reused.trace(1792, 5)
    assert peak(after_fresh, "host") == peak(alone, "host") and peak(after_fresh) == peak(alone)
    assert peak(after_reused, "host").total != peak(alone, "host").total  # the pool's slack: why profiles are fresh
