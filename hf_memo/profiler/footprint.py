"""Peak device and host memory of one training step at any sequence length, from fake-tensor profiles.

A :class:`StepProfiler` holds one training setup (model config, dtype, batch size, optimizer and a
``prepare`` function that turns the bare model into the one trained: LoRA, checkpointing, hf_memo).
Deep models are profiled at two shallow depths and extrapolated (see :mod:`.extrapolate`); models no
deeper than that are profiled whole. Fake models are built once per depth and reused for every
sequence length.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_memo.profiler.analysis import Peak, peak
from hf_memo.profiler.extrapolate import extrapolated_peak
from hf_memo.profiler.trace import AllocationTrace

if TYPE_CHECKING:  # PyTorch, the fake-tensor machinery and the model code load when a profiler builds its first model
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from hf_memo.profiler.fake_model import FakeSession
    from hf_memo.profiler.kernel_workspace import KernelTarget

PROFILE_LAYERS = (2, 3)


@dataclass(frozen=True)
class Footprint:
    """Peak bytes of one step on the device and on the host (offloaded tensors), and how they were found."""

    seq_len: int
    device: Peak
    host: Peak
    layers: int
    method: str


def with_layers(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of ``config`` with ``layers`` decoder layers."""
    shallow = copy.deepcopy(config)
    shallow.get_text_config().num_hidden_layers = layers
    return shallow


class StepProfiler:
    """Profiles one training setup at any sequence length.

    Args:
        config: the full model's config.
        prepare: ``prepare(model, session) -> model``, run inside the fake session right after the
            bare ``*ForCausalLM`` is built: wraps (PEFT) or patches (checkpointing, hf_memo) it.
        dtype: parameter dtype (default bfloat16).
        batch_size: sequences per step.
        optimizer: ``"adamw"`` or ``"none"`` (see :func:`trace_training_step`).
        on_profile: called as ``on_profile(layers, seq_len)`` after each profiled step (progress).
        meta: added to every trace's ``meta``.
        profile_layers: the two depths a deeper model is profiled at; every layer after the first of them
            must behave like the others (e.g. under the memo executor, depth 4 is the first with both
            rounding buffers in use and two layers kept on the device).
        fresh: build a new model (and so a new hf_memo runtime and host pool) for every traced step, so that no
            profile depends on what was profiled before it (a runtime's host pool reuses the buffers of an earlier,
            longer step).
        kernels: the device the profiles are for (see :func:`~hf_memo.profiler.step.trace_training_step`): by
            default an H100/H200 with flash-attn, whose attention workspace the CPU kernel's profile lacks.
        sequence_parallel: ranks ``K`` one sequence is split over: every profile is rank 0's under a fake process
            group of ``K`` ranks (``prepare`` sets up the sequence parallelism), and a length is the rank's
            positions (``S / K``): the step traced is of ``K`` times as many.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        prepare: Callable[[nn.Module, FakeSession], nn.Module],
        dtype: torch.dtype | None = None,
        batch_size: int = 1,
        optimizer: str = "adamw",
        on_profile: Callable[[int, int], None] | None = None,
        meta: dict[str, Any] | None = None,
        profile_layers: tuple[int, int] = PROFILE_LAYERS,
        fresh: bool = False,
        kernels: str | KernelTarget = "cuda",
        sequence_parallel: int = 1,
    ) -> None:
        self.config = config
        self.profile_layers = profile_layers
        self.layers = config.get_text_config().num_hidden_layers
        self._prepare = prepare
        if dtype is None:
            import torch

            dtype = torch.bfloat16
        self._dtype = dtype
        self.batch_size = self._batch_size = batch_size
        self._optimizer = optimizer
        self._on_profile = on_profile
        self._meta = meta or {}
        self._fresh = fresh
        self._kernels = kernels
        self.sequence_parallel = sequence_parallel
        self._models: dict[int, tuple[nn.Module, FakeSession]] = {}

    def model(self, layers: int) -> nn.Module:
        """The prepared fake model with ``layers`` decoder layers (built once)."""
        return self._model(layers)[0]

    def _model(self, layers: int) -> tuple[nn.Module, FakeSession]:
        from hf_memo.profiler.fake_world import fake_world

        if layers not in self._models:
            with fake_world(self.sequence_parallel):
                self._build(layers)
        return self._models[layers]

    def _build(self, layers: int) -> tuple[nn.Module, FakeSession]:
        """The prepared model of ``layers`` (built here, in this process's process group, if not built yet)."""
        from hf_memo.profiler.fake_model import fake_causal_lm

        if layers not in self._models:
            model, session = fake_causal_lm(with_layers(self.config, layers), self._dtype)
            with session:
                model = self._prepare(model, session)
            self._models[layers] = (model, session)
        return self._models[layers]

    def trace(self, seq_len: int, layers: int | None = None) -> AllocationTrace:
        """The allocation trace of one step on ``(batch_size, seq_len)`` tokens (each rank's), with ``layers``
        (default all)."""
        from hf_memo.profiler.fake_world import fake_world
        from hf_memo.profiler.step import trace_training_step

        layers = self.layers if layers is None else layers
        k = self.sequence_parallel
        fresh = self._fresh or k > 1  # a model is bound to the (fake) process group it was prepared in
        with fake_world(k):
            if fresh:
                self._models.pop(layers, None)
            model, session = self._build(layers)
            if fresh:
                del self._models[layers]
            with session:
                trace = trace_training_step(
                    model, self._batch_size, k * seq_len, self._optimizer, self._meta, self._kernels
                )
        if self._on_profile is not None:
            self._on_profile(layers, seq_len)
        return trace

    def footprint(self, seq_len: int) -> Footprint:
        """Peak device and host bytes at ``seq_len``: a full profile, or two shallow ones extrapolated."""
        shallow, deeper = self.profile_layers
        if self.layers <= deeper:
            trace = self.trace(seq_len)
            method = f"profiled all {self.layers} layers on fake tensors"
            return Footprint(seq_len, peak(trace, "device"), peak(trace, "host"), self.layers, method)
        small, large = self.trace(seq_len, shallow), self.trace(seq_len, deeper)
        method = (
            f"profiled {shallow} and {deeper} of {self.layers} layers on fake tensors, extrapolated linearly in layers"
        )
        return Footprint(
            seq_len,
            extrapolated_peak(small, large, self.layers, "device"),
            extrapolated_peak(small, large, self.layers, "host"),
            self.layers,
            method,
        )
