"""Profiling without GPU memory: fake-tensor models and peak memory by category."""

from hf_memo.profiler.fake_model import FakeSession, fake_causal_lm
from hf_memo.profiler.memtracker import PeakBreakdown, peak_of, training_step_peak

__all__ = ["FakeSession", "PeakBreakdown", "fake_causal_lm", "peak_of", "training_step_peak"]
