"""Profiling without GPU memory: fake-tensor models, allocation traces, peaks and their extrapolation.

The public names are imported on first use (PEP 562): a closed form read back from the estimator's cache is
evaluated without importing the fake-tensor machinery and the model code behind it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_memo.lazy_names import lazy_names

if TYPE_CHECKING:
    from hf_memo.profiler.analysis import Peak, check_identical_layers, layer_trace, peak
    from hf_memo.profiler.fake_model import FakeSession, fake_causal_lm
    from hf_memo.profiler.footprint import Footprint, StepProfiler
    from hf_memo.profiler.memtracker import PeakBreakdown, peak_of, training_step_peak
    from hf_memo.profiler.step import trace_training_step
    from hf_memo.profiler.trace import AllocationEvent, AllocationTrace

_PUBLIC = {  # name -> the module it comes from
    "Peak": "hf_memo.profiler.analysis",
    "check_identical_layers": "hf_memo.profiler.analysis",
    "layer_trace": "hf_memo.profiler.analysis",
    "peak": "hf_memo.profiler.analysis",
    "FakeSession": "hf_memo.profiler.fake_model",
    "fake_causal_lm": "hf_memo.profiler.fake_model",
    "Footprint": "hf_memo.profiler.footprint",
    "StepProfiler": "hf_memo.profiler.footprint",
    "PeakBreakdown": "hf_memo.profiler.memtracker",
    "peak_of": "hf_memo.profiler.memtracker",
    "training_step_peak": "hf_memo.profiler.memtracker",
    "trace_training_step": "hf_memo.profiler.step",
    "AllocationEvent": "hf_memo.profiler.trace",
    "AllocationTrace": "hf_memo.profiler.trace",
}

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


__getattr__ = lazy_names(__name__, _PUBLIC)
