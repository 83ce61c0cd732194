"""Profiling without GPU memory: fake-tensor models, allocation traces, peaks and their extrapolation."""

from hf_memo.profiler.analysis import Peak, check_identical_layers, layer_trace, peak
from hf_memo.profiler.fake_model import FakeSession, fake_causal_lm
from hf_memo.profiler.footprint import Footprint, StepProfiler
from hf_memo.profiler.memtracker import PeakBreakdown, peak_of, training_step_peak
from hf_memo.profiler.step import trace_training_step
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace

__all__ = [
    "AllocationEvent",
    "AllocationTrace",
    "FakeSession",
    "Footprint",
    "Peak",
    "PeakBreakdown",
    "StepProfiler",
    "check_identical_layers",
    "fake_causal_lm",
    "layer_trace",
    "peak",
    "peak_of",
    "trace_training_step",
    "training_step_peak",
]
