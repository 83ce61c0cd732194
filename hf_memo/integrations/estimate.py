"""``hf_memo.estimate`` and ``hf-memo estimate``: peak memory of a training step and the longest sequence that fits.

Every setup ("mode", see :mod:`hf_memo.integrations.setups`) is profiled on fake tensors, so any model is
estimated on a CPU without its weights: a few fresh profiles at short lengths fix a closed form of its peak memory
in the step's sizes (:mod:`hf_memo.integrations.fitted`), and every length, the longest that fits among them, is
read off the closed form. The profiles of all modes are independent and run side by side, one worker process per
CPU (:mod:`hf_memo.profiler.workers`). Bytes the profile finds on the host (offloaded tensors) count as host
memory, everything else as device memory. The memo mode runs the memory-policy solver on its closed form (see
:mod:`hf_memo.integrations.memo_estimate`): its longest sequence is the longest for which some policy fits the
device, the host and the pinned memory. Multi-GPU jobs (:mod:`hf_memo.integrations.cluster`) are one rank's
profile at ``S / K`` tokens with its share of the model states. Step times are bounds, not measurements: FLOPs at
the GPU's peak plus the host copies compute cannot hide.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import torch
from torch import nn
from tqdm.auto import tqdm

from hf_memo.integrations.cluster import (
    DEVICE_RESERVE,
    HOST_RESERVE_NODE,
    HOST_RESERVE_PER_RANK,
    PINNABLE_FRACTION,
    Cluster,
    DeepSpeedConfig,
    GiB,
    ModelStates,
    RankStates,
    all_to_all_bytes,
    rank_peak,
    rank_state_bytes,
    rank_states,
)
from hf_memo.integrations.fit_cache import CACHE_ENV, FitCache, cache_dir
from hf_memo.integrations.fitted import BASE_CHUNKS, ConfigFacts, FittedFootprint, ProfilePlan
from hf_memo.integrations.memo_estimate import (
    DEFAULT_GPU,
    GPUS,
    Budget,
    Gpu,
    MemoModel,
    ModelFacts,
    attention_imbalance,
    gpu_of,
    model_flops,
    step_seconds,
)
from hf_memo.integrations.setups import (
    AUTO_CHUNKS,
    CURRENT_MODES,
    DEFAULT_MODES,
    DTYPES,
    LORA_RANK,
    MODES,
    POSITION_LIMITS,
    TRAINABLE,
    Chunks,
    Lora,
    choice,
    config_of,
    memo_with_offload,
    memo_with_policy,
    parse,
    positive_int,
    resolve_modes,
    with_lora,
)
from hf_memo.parallel.heads import check_head_counts
from hf_memo.planner.policy import MemoryPolicy
from hf_memo.profiler.analysis import Peak
from hf_memo.profiler.footprint import PROFILE_LAYERS, Footprint, StepProfiler
from hf_memo.profiler.plot import plot_timelines
from hf_memo.profiler.search import longest_fitting
from hf_memo.profiler.shapes import SHAPE_NAMES
from hf_memo.profiler.step import OPTIMIZERS
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.profiler.workers import run_side_by_side, usable_cpus
from hf_memo.units import format_bytes, parse_bytes, parse_tokens

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from hf_memo.profiler.fake_model import FakeSession

SCAN = 0.02  # past the bisection's answer, lengths up to this fraction longer are checked too (chunk rows vary)
SEARCH_LIMIT = 1 << 24  # the longest sequence searched for, in tokens, unless the model's learned positions stop sooner
# Where Estimate.host_memory came from: an argument of estimate(), the command line's flag, or this machine's RAM
# (the command line's default).
HOST_FROM_ARGUMENT, HOST_FROM_FLAG, HOST_FROM_THIS_MACHINE = "the host_memory argument", "--host-memory", "this machine"


@dataclass(frozen=True)
class ModeEstimate:
    """One mode's result: one rank's footprint at the requested length and the longest length that fits."""

    mode: str
    description: str
    footprint: Footprint
    fits: bool
    longest_seq_len: int | None
    longest_is_search_limit: bool = False
    policy: str | None = None  # memo: the memory policy at the requested length (layers per kind, where)
    step_seconds: float | None = None  # a lower bound: FLOPs at the GPU's peak plus exposed copies (None: no fit)
    mfu: float | None = None  # an upper bound: model FLOPs / (step time bound x peak)
    binding: str | None = None  # what stops a longer sequence: "device", "host" or "pinned"

    @property
    def bound_by(self) -> str | None:
        """What stops a longer sequence: ``"search cap"`` when the search stopped before anything else did, else
        :attr:`binding`."""
        return "search cap" if self.longest_is_search_limit else self.binding

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["binding"] = self.bound_by
        record["footprint"]["device"].pop("index")
        record["footprint"]["host"].pop("index")
        return record


@dataclass
class Estimate:
    """Per-mode memory estimates of one training setup (see :func:`estimate`)."""

    model: str
    layers: int
    seq_len: int
    batch_size: int
    dtype: str
    trainable: str
    optimizer: str
    gpu_memory: int
    host_memory: int | None
    modes: dict[str, ModeEstimate]
    gpu: str = DEFAULT_GPU
    cluster: Cluster = field(default_factory=Cluster)
    pinned_memory: int | None = None
    reserve: int = 0  # bytes of each GPU the step may not use
    host_reserve: int = 0  # bytes of each node's host memory the ranks may not use
    states: RankStates | None = None  # one rank's DeepSpeed model states (None without ZeRO)
    host_per_rank: float | None = None  # host bytes one rank may use (its share, less the reserve)
    host_memory_limit: int | None = None  # MemoConfig.host_memory_limit every rank must set
    host_memory_source: str = HOST_FROM_ARGUMENT  # where host_memory came from (HOST_FROM_*)
    lora: Lora | None = None  # what LoRA trains (trainable "lora"), its default targets filled in
    parameters: int = 0  # of the whole trained model (LoRA: base weights, adapters and trainable copies)
    trainable_parameters: int = 0
    search_limit: int = SEARCH_LIMIT  # the longest sequence searched for
    traces: dict[str, AllocationTrace] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        record = {k: v for k, v in asdict(self).items() if k not in ("modes", "traces")}
        record["modes"] = {name: result.to_dict() for name, result in self.modes.items()}
        return record

    def _methods(self) -> list[str]:
        """One "Method:" line, or one per mode when modes were profiled differently."""
        methods = {name: result.footprint.method for name, result in self.modes.items()}
        if len(set(methods.values())) == 1:
            return [f"Method: {next(iter(methods.values()))}."]
        return [f"Method ({name}): {method}." for name, method in methods.items()]

    def table(self) -> str:
        """The side-by-side text table the command line prints."""
        names = list(self.modes)
        per_rank = self.cluster.num_gpus > 1
        rows: list[tuple[str, list[str]]] = []
        for category in ("parameter", "gradient", "optimizer", "activation", "temporary", "buffer"):
            label = {"optimizer": "optimizer state", "temporary": "temporaries"}.get(category, category + "s")
            rows.append(
                (f"  {label}", [format_bytes(self.modes[n].footprint.device.by_category[category]) for n in names])
            )
        rank = " per GPU" if per_rank else ""
        rows.append((f"peak device memory{rank}", [format_bytes(self.modes[n].footprint.device.total) for n in names]))
        rows.append(("  reached in", [self.modes[n].footprint.device.phase for n in names]))
        rows.append((f"peak host memory{rank}", [format_bytes(self.modes[n].footprint.host.total) for n in names]))
        budget = format_bytes(self.gpu_memory) + (
            f" + {format_bytes(self.host_memory)} host" if self.host_memory is not None else ""
        )
        rows.append((f"fits {budget}", ["yes" if self.modes[n].fits else "no" for n in names]))
        if any(self.modes[n].longest_seq_len is not None for n in names):
            rows.append(("longest sequence", [_longest(self.modes[n]) for n in names]))
            rows.append(("  bound by", [self.modes[n].bound_by or "-" for n in names]))
        rows.append(("step time ≥ (bound)", [_seconds(self.modes[n].step_seconds) for n in names]))
        rows.append(
            ("MFU ≤ (bound)", ["-" if self.modes[n].mfu is None else f"{self.modes[n].mfu:.0%}" for n in names])
        )
        label_width = max(len(label) for label, _ in rows) + 2
        width = 2 + max(len(cell) for cell in names + [v for _, values in rows for v in values])
        host = f", host memory {format_bytes(self.host_memory)}" if self.host_memory is not None else ""
        if per_rank and self.host_memory is not None:
            host += f" per node ({self.cluster.ranks_per_node} GPUs)"
        if self.pinned_memory is not None:
            host += f", of which {format_bytes(self.pinned_memory)} may be pinned"
        lines = [
            *self._host_source(),
            f"{self.model}: {self.layers} layers, {self.dtype}, batch {self.batch_size} x {self.seq_len:,} tokens, "
            f"{self._training()}, optimizer {self._optimizer()}",
            f"{self.cluster.describe()}; GPU memory {format_bytes(self.gpu_memory)}{host}",
            *self._memory_lines(),
            *self._methods(),
            "",
            " " * label_width + "".join(n.rjust(width) for n in names),
        ]
        lines += [label.ljust(label_width) + "".join(v.rjust(width) for v in values) for label, values in rows]
        lines.append("")
        lines += [f"{n}: {self.modes[n].description}" for n in names]
        if any(self.modes[n].longest_is_search_limit for n in names):
            lines.append(self._search_cap())
        gpu = GPUS[self.gpu]
        lines.append(
            f"Step time and MFU are bounds, not measurements: FLOPs at the {gpu.name}'s bf16 dense peak "
            f"({gpu.peak_flops / 1e12:.0f} TFLOP/s, assumed) plus host copies at {gpu.host_bandwidth / 1e9:.0f} GB/s "
            "(assumed) that compute cannot hide; no kernel reaches the peak, and communication is not counted. "
            "Left out where the step does not fit."
        )
        if per_rank:
            lines.append(
                "Per GPU: one rank's activations at S / K tokens with its Ulysses all-to-all buffers (memo: profiled "
                "on one rank under a fake process group; other modes: an upper bound added at the peak), its ZeRO "
                "share of parameters, gradients and optimizer state; host memory is the node's, shared by its GPUs."
            )
        lines += [f"memo policy: {self.modes[n].policy}" for n in names if self.modes[n].policy]
        return "\n".join(lines)

    def _host_source(self) -> list[str]:
        """The host memory assumed and where it came from; loud when it is this machine's RAM (the command line's
        default), which need not be the training machine's."""
        if self.host_memory is None:
            return ["Host memory: no limit (host_memory=None): host bytes are shown, none is refused."]
        amount = f"{format_bytes(self.host_memory)} per node"
        if self.host_memory_source != HOST_FROM_THIS_MACHINE:
            return [f"Host memory: {amount}, from {self.host_memory_source}."]
        return [f"WARNING: {line}" for line in this_machine_warning(self.host_memory)]

    def _training(self) -> str:
        """Full fine-tuning or what LoRA trains, and how many parameters are trained."""
        what = "full fine-tuning" if self.trainable == "full" else (self.lora or Lora()).describe()
        if not self.parameters:
            return what
        return f"{what} ({_count(self.trainable_parameters)} of {_count(self.parameters)} parameters trained)"

    def _search_cap(self) -> str:
        """What "≥" and a "search cap" bound mean."""
        why = "the estimator's limit" if self.search_limit >= SEARCH_LIMIT else "the model's learned positions"
        return (
            f"search cap: the search for the longest sequence stops at {self.search_limit:,} tokens ({why}); "
            '"≥ N" reached it, so longer sequences may fit too.'
        )

    def _optimizer(self) -> str:
        """The optimizer and the precision of its states."""
        if self.optimizer != "adamw":
            return "none"
        if self.states is None:
            return "AdamW (fused, states in the parameter dtype)"
        if self.cluster.deepspeed.pure_bf16:
            return "AdamW under DeepSpeed, bf16 master weights, gradients and moments"
        return "AdamW under DeepSpeed's bf16 mixed precision (fp32 master weights, gradients and moments)"

    def _memory_lines(self) -> list[str]:
        """What the budgets leave out (reserves), DeepSpeed's model states, and the host limit memo needs."""
        lines = []
        if self.reserve or self.host_reserve:
            lines.append(
                f"Reserved: {format_bytes(self.reserve)} of each GPU (CUDA context and cuBLAS workspace, NCCL "
                f"buffers, fragmentation) and {format_bytes(self.host_reserve)} of each node's host memory (OS "
                "and processes): the step's budgets are what is left."
            )
        if self.states is not None:
            s = self.states
            lines.append(
                f"DeepSpeed model states per GPU ({self.cluster.deepspeed.describe()}): device "
                f"{format_bytes(s.device(True))} in backward (parameters {format_bytes(s.parameters)}, "
                f"{format_bytes(s.gathered)} of them gathered; gradients {format_bytes(s.gradients)}, "
                f"{format_bytes(s.buckets)} of them reduce buckets; optimizer {format_bytes(s.optimizer)}), "
                f"{format_bytes(s.step_total)} at the optimizer step; host {format_bytes(s.host)} "
                f"({format_bytes(s.host_pinned)} pinned)."
            )
        if self.host_per_rank is not None:
            lines.append(f"Host memory assumed per GPU: {format_bytes(self.host_per_rank)}" + self._host_use())
        return lines

    def _host_use(self) -> str:
        """Who takes the host memory of a rank, and the ``MemoConfig.host_memory_limit`` memo needs."""
        text = "" if self.states is None else f", {format_bytes(self.states.host)} of it DeepSpeed's"
        if "memo" not in self.modes or self.host_memory_limit is None:
            return text + "."
        ranks = self.cluster.ranks_per_node
        default = "half the RAM available when each process starts" + (
            f", which {ranks} ranks of a node would over-commit" if ranks > 1 else ""
        )
        return (
            f"{text}; memo's stashes may take {format_bytes(self.host_memory_limit)}: set "
            f'MemoConfig(host_memory_limit="{self.host_memory_limit // GiB}GiB") in every rank (the default, '
            f'"auto", is {default}).'
        )


def this_machine_warning(host_memory: int) -> list[str]:
    """What to say when the host memory assumed is this machine's RAM (``host_memory`` bytes)."""
    return [
        f"host memory {format_bytes(host_memory)} per node is THIS machine's RAM (no --host-memory given), not "
        "necessarily the training machine's.",
        "memo's stashes and DeepSpeed's offloaded states live there: pass --host-memory with the training node's "
        "memory, e.g. --host-memory 1TiB.",
    ]


def _seconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def _count(n: int) -> str:
    """``8030261248 -> '8.03B'``, ``3407872 -> '3.41M'``."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _longest(result: ModeEstimate) -> str:
    if result.longest_seq_len is None:
        return "-"
    return ("≥ " if result.longest_is_search_limit else "") + f"{result.longest_seq_len:,}"


def _longest_fitting(usage: Callable[[int], float], start: int, limit: int) -> int:
    """The longest length whose ``usage`` is at most 1: the bracketing search, then every length up to ``SCAN``
    longer (chunk rows, and so usage, go up and down a little between neighbouring lengths)."""
    longest = longest_fitting(usage, start, limit=limit)
    if longest == 0:
        return 0
    for seq_len in range(longest + 256, min(limit, int(longest * (1 + SCAN))) + 1, 256):
        if usage(seq_len) <= 1:
            longest = seq_len
    return longest


# This process's closed forms, by what they depend on: a repeated question profiles nothing. Profiles are
# deterministic and each starts from a fresh model, so reusing a closed form changes no answer.
_CLOSED_FORMS: dict[tuple, Any] = {}


class _Job:
    """What every mode of one question shares: the model, the ranks, the budgets and the profilers' settings."""

    def __init__(
        self,
        model: ResolvedModel,
        dtype: torch.dtype,
        batch_size: int,
        optimizer: str,
        trainable: str,
        cluster: Cluster,
        gpu: Gpu,
        budget: Budget,
        search_limit: int,
        bar: Any,
        lora: Lora | None = None,
        cache: FitCache | None = None,
    ) -> None:
        self.lora = lora
        self.cache = cache or FitCache(enabled=False)
        self.model, self.name, self.dtype, self.batch_size = model, model.name, dtype, batch_size
        self.optimizer, self.trainable, self.cluster, self.gpu = optimizer, trainable, cluster, gpu
        self.budget, self.search_limit, self.bar = budget, search_limit, bar
        self.workers: int | None = None  # processes profiles run in (closed_forms sets it)
        self.dtype_name = {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))
        self._states: ModelStates | None = None

    def key(self, mode: str) -> tuple:
        """What a mode's closed form depends on: the model, the setup, the longest length profiles may take and (memo,
        whose policies are profiled on one rank) the sequence-parallel degree. Not the budgets (profiles have no
        memory limit), the GPU's speed or the ZeRO settings: they are applied to the fit, not fitted."""
        k = self.cluster.sequence_parallel if mode == "memo" else 1
        return (
            "fit",
            self.model.digest,
            mode,
            self.trainable,
            self.lora,
            self.batch_size,
            self.dtype_name,
            self.optimizer,
            self.search_limit,
            k,
        )

    @property
    def config(self) -> PretrainedConfig:
        """The model's Transformers config (read when a profile needs it: a cached fit does not)."""
        return self.model.config()

    def profiler(self, mode: str, configure: Callable[[nn.Module], None], sequence_parallel: int = 1) -> StepProfiler:
        """A fresh-model profiler of ``mode`` whose model ``configure`` sets up (after LoRA, if asked); with
        ``sequence_parallel`` ``K > 1``, of rank 0 of ``K`` under a fake process group."""

        def prepare(model: nn.Module, session: FakeSession) -> nn.Module:
            if self.trainable == "lora":
                model = with_lora(model, session, self.lora)
            configure(model)
            return model

        meta = {"model": self.name, "mode": mode, "dtype": self.dtype_name, "trainable": self.trainable}
        return StepProfiler(
            self.config,
            prepare,
            self.dtype,
            self.batch_size,
            self.optimizer,
            meta=meta,
            profile_layers=MODES[mode].profile_layers,
            fresh=True,
            sequence_parallel=sequence_parallel,
        )

    def profiler_for(self, mode: str) -> Callable[[Chunks], StepProfiler]:
        """``profiler_for(chunks)``: fresh-model profilers of a mode other than memo with those chunk settings."""
        spec = MODES[mode]

        def profiler_for(chunks: Chunks) -> StepProfiler:
            if spec.configure_chunked is not None:
                return self.profiler(mode, lambda model: spec.configure_chunked(model, self.budget.host, chunks))
            return self.profiler(mode, lambda model: spec.configure(model, self.budget.host))

        return profiler_for

    def memo_profiler_for(self, fraction: float, chunks: Chunks) -> StepProfiler:
        """A fresh-model profiler of the memo mode with a fixed offload fraction and those chunk settings."""
        return self.profiler("memo", memo_with_offload(fraction, chunks))

    def policy_profiler_for(self, policy: MemoryPolicy, chunks: Chunks) -> StepProfiler:
        """A fresh-model profiler of the memo mode running ``policy`` with those chunk settings; under sequence
        parallelism, of one rank running hf_memo's Ulysses code (its exchanges' buffers are in the profile)."""
        k = self.cluster.sequence_parallel
        return self.profiler("memo", memo_with_policy(policy, chunks, k), k)

    def run_jobs(self, jobs: Sequence[Callable[[], AllocationTrace]]) -> list[AllocationTrace]:
        """Traces of ``jobs``, run side by side (memo's further policy profiles), on the progress bar."""
        self.bar.reset(total=len(jobs))
        self.bar.set_postfix_str("memo: profiles of its chosen policy")
        return run_side_by_side(jobs, self.workers, lambda index: self.bar.update())

    def profile_jobs(self, mode: str) -> list[Callable[[], AllocationTrace]]:
        """The profiles ``mode``'s closed form is fitted to (see :meth:`closed_form`), as jobs."""
        if mode == "memo":
            return MemoModel.jobs(self.memo_profiler_for, self.policy_profiler_for, self.search_limit)
        base = self.profiler_for(mode)(BASE_CHUNKS)
        return ProfilePlan.of(base, MODES[mode].chunking, self.search_limit).jobs(self.profiler_for(mode))

    def closed_form(self, mode: str, traces: Sequence[AllocationTrace]) -> FittedFootprint | MemoModel:
        """``mode``'s closed form (memo: its :class:`MemoModel`) from the results of :meth:`profile_jobs`."""
        if mode == "memo":
            k = self.cluster.sequence_parallel
            memo = MemoModel(
                self.memo_profiler_for,
                self.batch_size,
                self.gpu,
                self.search_limit,
                k,
                None,
                traces,
                self.policy_profiler_for,
                self.run_jobs,
            )
            return self.bind(memo)
        profiler_for = self.profiler_for(mode)
        fitted = FittedFootprint(profiler_for, MODES[mode].chunking, self.search_limit, traces)
        return ModeFit(fitted, ModelFacts.of(profiler_for(AUTO_CHUNKS).model(fitted.depths[0])))

    def bind(self, form: ModeFit | MemoModel) -> ModeFit | MemoModel:
        """A closed form made ready for this question (memo's: its GPU, a rank's model states, the profilers and
        runner of further block structures)."""
        if isinstance(form, MemoModel):
            adjust = self.adjust(form.facts.element_size, all_to_all=False)  # memo's policies are profiled on a rank
            form.rebind(self.gpu, adjust, self.restate, self.policy_profiler_for, self.run_jobs)
        return form

    def states(self) -> ModelStates:
        """The whole model's parameter counts (see :func:`model_states`)."""
        if self._states is None:
            self._states = _model_states(
                self.model, self.dtype, self.trainable, self.optimizer, self.cluster, self.lora, self.cache
            )
        return self._states

    def adjust(self, element: int, all_to_all: bool = True) -> Callable[[Peak, int], tuple[Peak, int]]:
        """One rank's device peak and the host bytes of its model states, from a peak at its tokens chosen among
        moments :meth:`restate` restated: a single GPU's (``all_to_all``: the Ulysses exchanges' bytes are added) or
        a rank's (they are in it); ``element`` is the bytes of one activation element."""

        def adjust(device: Peak, rank_seq_len: int) -> tuple[Peak, int]:
            if self.cluster.num_gpus == 1 and self.cluster.zero == 0:
                return device, 0
            a2a = (
                all_to_all_bytes(self.model.facts, self.cluster, self.batch_size, rank_seq_len, element)
                if all_to_all
                else 0
            )
            return rank_peak(device, self.states(), self.cluster, a2a, restated=True)

        return adjust

    def restate(self, values: np.ndarray) -> np.ndarray:
        """Profile moments' device bytes by category with the model states as a rank holds them (ZeRO), so the
        highest moment is chosen with them (:func:`~hf_memo.integrations.cluster.rank_state_bytes`)."""
        return rank_state_bytes(values, self.states(), self.cluster)


@dataclass
class ModeFit:
    """A mode's closed form and what the step-time bound and a rank's accounting need of its model (every mode but
    memo, whose :class:`MemoModel` holds both)."""

    footprint: FittedFootprint
    facts: ModelFacts


def _mode_estimate(job: _Job, mode: str, fit: ModeFit, seq_len: int, search: bool) -> ModeEstimate:
    """A mode whose memory is what its closed form shows (every mode but memo)."""
    spec = MODES[mode]
    fitted, facts = fit.footprint, fit.facts
    adjust, cluster = job.adjust(facts.element_size), job.cluster

    def at(length: int) -> tuple[Footprint, dict[str, float]]:
        rank_len = cluster.rank_seq_len(length)
        footprint = fitted.footprint(rank_len, restate=job.restate)
        device, state_host = adjust(footprint.device, rank_len)
        host = footprint.host.total + state_host
        by_category = dict(footprint.host.by_category)
        by_category["optimizer"] += state_host
        footprint = Footprint(length, device, Peak(host, by_category), footprint.layers, footprint.method)
        return footprint, job.budget.shares(device.total, host, footprint.host.total - state_host)

    footprint, shares = at(seq_len)
    fits = max(shares.values()) <= 1
    longest = binding = None
    if search:
        longest = _longest_fitting(lambda s: max(at(s)[1].values()), seq_len, job.search_limit)
        past = at(longest + 256)[1]
        binding = max(past, key=past.__getitem__)
    flops, batch, layers = facts.flops, job.batch_size, fitted.layers
    seconds = mfu = None
    if fits:
        k = cluster.sequence_parallel
        head = facts.head_seconds(batch, seq_len, job.gpu) / k
        scale = attention_imbalance(fitted.config, k)  # the busiest rank's attention (uneven head split)
        seconds = step_seconds(mode, flops, layers, head * k, batch, seq_len, job.gpu, scale) / k
        mfu = model_flops(flops, layers, head * k, batch, seq_len, job.gpu) / k / (seconds * job.gpu.peak_flops)
    result = ModeEstimate(
        mode,
        spec.description,
        footprint,
        fits,
        longest,
        longest is not None and longest >= job.search_limit - job.search_limit % 256,
        step_seconds=seconds,
        mfu=mfu,
        binding=binding,
    )
    return result


MEMO_DESCRIPTION = (
    "hf_memo.apply(recompute='memo'): MEMO executor under the memory policy its solver picks (per layer: keep "
    "X + attention or X only, on the host or the device, and alpha); memory from its profile and the policy"
)


def memo_mode_estimate(memo: MemoModel, seq_len: int, budget: Budget, search: bool, search_limit: int) -> ModeEstimate:
    """The memo mode: the fastest policy that fits at ``seq_len`` (one rank's ``seq_len / K`` positions of each
    sequence, ``seq_len`` being the whole sequence's); the longest length some policy fits."""
    k = memo.sequence_parallel
    choice_ = memo.choose(-(-seq_len // k), budget)
    longest = binding = None
    if search:
        longest = _longest_fitting(lambda s: memo.smallest_usage(-(-s // k), budget)[0], seq_len, search_limit)
        binding = memo.smallest_usage(-(-(longest + 256) // k), budget)[1]
    footprint = Footprint(seq_len, choice_.device, choice_.host, memo.layers, memo.method)
    policy, seconds, mfu = choice_.policy, None, None
    if policy is not None:
        batch = memo.batch_size
        head = memo.facts.head_seconds(batch, seq_len, memo.gpu) / k
        seconds = policy.predicted_step_seconds + head
        useful = model_flops(memo.flops, memo.layers, head * k, batch, seq_len, memo.gpu) / k
        mfu = useful / (seconds * memo.gpu.peak_flops)
    return ModeEstimate(
        "memo",
        MEMO_DESCRIPTION,
        footprint,
        policy is not None,
        longest,
        longest is not None and longest >= search_limit - search_limit % 256,
        policy=policy.summary() if policy is not None else f"none fits: {choice_.shortfall}",
        step_seconds=seconds,
        mfu=mfu,
        binding=binding,
    )


# More workers than the memo mode's seven profiles hardly shorten the run (its profiles are the longest) and each
# worker fills its own fake-tensor caches: the default stops at eight.
MAX_WORKERS = 8
# one profile's time, relative to plain Hugging Face's
PROFILE_WEIGHT = {"memo": 3.0, "minseq": 1.5, "full": 1.5, "selective": 1.5, "none": 1.3, "hf-checkpointing": 1.2}


def _known(job: _Job, mode: str, cache: FitCache) -> bool:
    """Whether ``mode``'s closed form is at hand: fitted before in this process, or read now from ``cache``."""
    key = job.key(mode)
    if key not in _CLOSED_FORMS:
        form = cache.load(cache.key(key))
        if form is None:
            return False
        _CLOSED_FORMS[key] = form
    return True


def closed_forms(job: _Job, modes: Sequence[str], workers: int | None, cache: FitCache | None = None) -> dict[str, Any]:
    """Each mode's closed form (memo: its :class:`MemoModel`, bound to this question). Those fitted before in this
    process or kept in ``cache`` are reused; the profiles of every other mode run side by side (see
    :func:`~hf_memo.profiler.workers.run_side_by_side`), the slowest first, and their fits are stored in ``cache``."""
    cache = cache or FitCache(enabled=False)
    missing = [mode for mode in modes if not _known(job, mode, cache)]
    jobs = {mode: job.profile_jobs(mode) for mode in missing}
    order = [(mode, index) for mode in missing for index in range(len(jobs[mode]))]
    order.sort(key=lambda item: -PROFILE_WEIGHT.get(item[0], 1.0))
    job.bar.reset(total=len(order))
    done: dict[str, int] = dict.fromkeys(missing, 0)

    def on_done(position: int) -> None:
        mode = order[position][0]
        done[mode] += 1
        job.bar.set_postfix_str(f"{mode} {done[mode]}/{len(jobs[mode])}")
        job.bar.update()

    workers = min(usable_cpus(), MAX_WORKERS) if workers is None else workers
    job.workers = workers
    traces = run_side_by_side([jobs[mode][index] for mode, index in order], workers, on_done) if order else []
    by_mode: dict[str, list[AllocationTrace]] = {mode: [None] * len(jobs[mode]) for mode in missing}  # type: ignore[misc]
    for (mode, index), trace in zip(order, traces):
        by_mode[mode][index] = trace
    for mode in missing:
        _CLOSED_FORMS[job.key(mode)] = form = job.closed_form(mode, by_mode[mode])
        cache.store(cache.key(job.key(mode)), form)
    return {mode: job.bind(_CLOSED_FORMS[job.key(mode)]) for mode in modes}


def estimate(
    model_or_config: str | PretrainedConfig | nn.Module,
    seq_len: int | str,
    gpu_memory: int | str = "80GiB",
    host_memory: int | str | None = None,
    batch_size: int = 1,
    trainable: str = "full",
    optimizer: str = "adamw",
    modes: Sequence[str] = DEFAULT_MODES,
    dtype: torch.dtype = torch.bfloat16,
    search: bool = True,
    keep_traces: bool = False,
    progress: bool = True,
    gpu: str = DEFAULT_GPU,
    cluster: Cluster | None = None,
    pinned_memory: int | str | None = None,
    workers: int | None = None,
    reserve: int | str | None = None,
    host_reserve: int | str | None = None,
    lora_rank: int | None = None,
    lora_targets: str | Sequence[str] | None = None,
    trainable_modules: str | Sequence[str] | None = None,
    cache: bool | FitCache = True,
) -> Estimate:
    """Peak device memory by category, host memory and the longest sequence that fits, per mode.

    Args:
        model_or_config: a built-in name (``"llama-3-8b"``, ...), a path to a ``config.json``, a
            ``PretrainedConfig``, or a model (only its config is used; nothing is run on it).
        seq_len: tokens per sequence ``S`` (an int or ``"128k"``); batches are ``(batch_size, S)``.
        gpu_memory: device memory per GPU (``"80GiB"``, ``"80GB"`` or bytes); the step may use it less ``reserve``.
        host_memory: host memory per node for offloaded tensors (DeepSpeed's optimizer states and memo's
            stashes), less ``host_reserve``, shared by its ranks; ``None`` puts no limit on it.
        batch_size: sequences per step (per data-parallel group).
        trainable: ``"full"`` fine-tuning or ``"lora"`` (PEFT LoRA as ``lora_rank``, ``lora_targets`` and
            ``trainable_modules`` say).
        optimizer: ``"adamw"`` (fused AdamW, states in the parameter dtype) or ``"none"``.
        modes: names from :data:`MODES`.
        dtype: parameter dtype.
        search: also find the longest ``S`` (a multiple of 256) that fits ``gpu_memory`` (and the host and pinned
            memory); for memo, the longest for which some memory policy fits.
        keep_traces: keep each mode's full-depth allocation trace at ``seq_len`` (one rank's tokens) in
            ``Estimate.traces`` (memo: its smallest MEMO policy). A full-depth profile: slow for long sequences.
        progress: show a progress bar.
        gpu: the GPU whose peak FLOP/s and host bandwidth bound the step time (``"h100"``, ``"h200"``, ``"a100"``).
        cluster: ranks, sequence parallelism, ZeRO stage and optimizer offload (default: one GPU).
        pinned_memory: host memory per node that may be pinned (DeepSpeed's pinned offloaded states and memo's
            stashes); default: no limit beyond ``host_memory``. The command line's default is
            :data:`~hf_memo.integrations.cluster.PINNABLE_FRACTION` of the host memory left after the reserve.
        workers: processes that run the profiles side by side (default: one per CPU this process may use, at most
            :data:`MAX_WORKERS`; the answer does not depend on it).
        reserve: bytes of each GPU the step may not use (CUDA context, NCCL, fragmentation); default none (the
            command line's is :data:`~hf_memo.integrations.cluster.DEVICE_RESERVE`).
        host_reserve: bytes of each node's host memory its ranks may not use (OS, processes); default none.
        lora_rank: the rank of the LoRA adapters (default 8); only with ``trainable="lora"``.
        lora_targets: the modules LoRA adapts, a sequence or a comma-separated string of names (default: PEFT's
            default targets for the model type, e.g. ``q_proj, v_proj`` for Llama); only with ``trainable="lora"``.
        trainable_modules: modules trained in full beside the adapters (PEFT's ``modules_to_save``), e.g.
            ``"embed_tokens,norm"``; only with ``trainable="lora"``.
        cache: read and write fitted closed forms in the on-disk cache (:mod:`~hf_memo.integrations.fit_cache`;
            ``$HF_MEMO_CACHE_DIR`` or the user's cache directory), or a :class:`FitCache` to use; ``False`` fits
            everything again (closed forms fitted before in this process are still reused). The answer is the same.
    """
    choice("trainable", trainable, TRAINABLE)
    fit_cache = cache if isinstance(cache, FitCache) else FitCache(enabled=bool(cache))
    model = resolve_model(model_or_config, trainable, lora_rank, lora_targets, trainable_modules, fit_cache)
    name, facts, lora, search_limit = model.name, model.facts, model.lora, model.search_limit
    seq_len = parse_tokens(seq_len)
    gpu_bytes = parse_bytes(gpu_memory)
    host_bytes = None if host_memory is None else parse_bytes(host_memory)
    pinned_bytes = None if pinned_memory is None else parse_bytes(pinned_memory)
    cluster = cluster or Cluster()
    check_head_counts(
        cluster.sequence_parallel, facts.num_attention_heads, facts.num_key_value_heads, "sequence_parallel"
    )
    if gpu_bytes <= 0:
        raise ValueError(f"gpu_memory must be positive, got {gpu_memory!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    choice("optimizer", optimizer, OPTIMIZERS)
    if not modes or isinstance(modes, str):
        raise ValueError(f"modes must be a sequence naming at least one of {', '.join(CURRENT_MODES)}, got {modes!r}")
    modes, notes = resolve_modes(modes)
    for note in notes:
        warnings.warn(note, FutureWarning, stacklevel=2)
    if seq_len > search_limit:
        raise ValueError(f"{name} has learned positions for at most {search_limit:,} tokens, got seq_len {seq_len:,}")

    spec = gpu_of(gpu)
    reserve_bytes = 0 if reserve is None else parse_bytes(reserve)
    host_reserve_bytes = 0 if host_reserve is None else parse_bytes(host_reserve)
    states = _model_states(model, dtype, trainable, optimizer, cluster, lora, fit_cache)
    ranked = rank_states(states, cluster) if cluster.zero else None
    budget = rank_budget(gpu_bytes, host_bytes, pinned_bytes, reserve_bytes, host_reserve_bytes, cluster, ranked)
    bar = tqdm(desc="profiling", unit="step", disable=not progress, leave=False)
    results: dict[str, ModeEstimate] = {}
    traces: dict[str, AllocationTrace] = {}
    try:
        job = _Job(
            model,
            dtype,
            batch_size,
            optimizer,
            trainable,
            cluster,
            spec,
            budget,
            search_limit,
            bar,
            lora,
            fit_cache,
        )
        forms = closed_forms(job, modes, workers, fit_cache)
        for mode in modes:
            if mode == "memo":
                structures = forms[mode].block_structures
                results[mode] = memo_mode_estimate(forms[mode], seq_len, budget, search, search_limit)
                if forms[mode].block_structures > structures:  # the answer profiled a policy of a new structure
                    fit_cache.store(fit_cache.key(job.key(mode)), forms[mode])
            else:
                results[mode] = _mode_estimate(job, mode, forms[mode], seq_len, search)
            if keep_traces:
                memo_profiler = job.profiler(mode, memo_with_offload(0.0)) if mode == "memo" else None
                profiler = memo_profiler or job.profiler_for(mode)(AUTO_CHUNKS)
                traces[mode] = profiler.trace(cluster.rank_seq_len(seq_len))
    finally:
        bar.close()
    layers = facts.num_hidden_layers
    return Estimate(
        name,
        layers,
        seq_len,
        batch_size,
        job.dtype_name,
        trainable,
        optimizer,
        gpu_bytes,
        host_bytes,
        results,
        gpu=gpu.lower(),
        cluster=cluster,
        pinned_memory=pinned_bytes,
        reserve=reserve_bytes,
        host_reserve=host_reserve_bytes,
        states=ranked,
        host_per_rank=budget.host,
        host_memory_limit=None if budget.host is None else int(budget.stash_room(ranked.host if ranked else 0)),
        lora=lora,
        parameters=states.parameters,
        trainable_parameters=states.trainable,
        search_limit=search_limit,
        traces=traces,
    )


def lora_of(
    trainable: str,
    rank: int | None,
    targets: str | Sequence[str] | None,
    modules: str | Sequence[str] | None,
    model_type: str,
) -> Lora | None:
    """What LoRA trains (``None`` for full fine-tuning, where the LoRA settings must be left out), with PEFT's
    default targets for ``model_type`` filled in when ``targets`` is ``None``."""
    if trainable != "lora":
        if rank is not None or targets is not None or modules is not None:
            raise ValueError("lora_rank, lora_targets and trainable_modules apply to trainable='lora' only")
        return None
    lora = Lora(LORA_RANK if rank is None else rank, _names(targets), _names(modules) or ())
    return lora.resolved(model_type)


def _names(names: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """Module names from a sequence or a comma-separated string (``None`` stays ``None``)."""
    if names is None:
        return None
    if isinstance(names, str):
        names = names.split(",")
    return tuple(name.strip() for name in names if name.strip())


@dataclass(frozen=True)
class ResolvedModel:
    """The model of a question as the estimate uses it: its name, what a fit reads of its config, the SHA-256 of
    the config's JSON (what fits are keyed by), what LoRA trains and the longest length its positions allow.
    ``config()`` reads the Transformers config itself, which only profiling needs."""

    name: str
    facts: ConfigFacts
    digest: str
    lora: Lora | None
    search_limit: int
    config: Callable[[], PretrainedConfig] = field(compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("name", "facts", "digest", "lora", "search_limit")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in {**state, "config": _unreadable}.items():
            object.__setattr__(self, name, value)


def _unreadable() -> PretrainedConfig:
    raise RuntimeError("a model read from the cache is bound to its loader by resolve_model")


def _model_source(model: str) -> tuple | None:
    """What a model given by name is, without reading it: a built-in name (its config is hf_memo's code), or a local
    ``config.json`` (its path and contents); ``None`` for a Hub id (read through Transformers every time)."""
    if model in SHAPE_NAMES:
        return ("builtin", model)
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if path.is_file():
        return ("file", str(path.resolve()), hashlib.sha256(path.read_bytes()).hexdigest())
    return None


def resolve_model(
    model_or_config: str | PretrainedConfig | nn.Module,
    trainable: str,
    lora_rank: int | None,
    lora_targets: str | Sequence[str] | None,
    trainable_modules: str | Sequence[str] | None,
    cache: FitCache | None = None,
) -> ResolvedModel:
    """The model of a question (see :class:`ResolvedModel`); a built-in name or a local ``config.json`` asked about
    before is read from ``cache``, without importing Transformers or PEFT (PEFT names LoRA's default targets)."""
    cache = cache or FitCache(enabled=False)
    source = _model_source(model_or_config) if isinstance(model_or_config, str) else None
    loaded: list[PretrainedConfig] = []

    def config() -> PretrainedConfig:
        if not loaded:
            loaded.append(config_of(model_or_config)[1])
        return loaded[0]

    key = None
    if source is not None:
        flags = (trainable, lora_rank, _names(lora_targets), _names(trainable_modules))
        key = cache.key(("model", source, flags))
        found = cache.load(key)
        if isinstance(found, ResolvedModel):
            object.__setattr__(found, "config", config)
            return found
    name, real = config_of(model_or_config)
    loaded.append(real)
    lora = lora_of(trainable, lora_rank, lora_targets, trainable_modules, real.model_type)
    limit_field = POSITION_LIMITS.get(real.model_type)
    search_limit = getattr(real, limit_field) if limit_field else SEARCH_LIMIT
    digest = hashlib.sha256(real.to_json_string().encode()).hexdigest()
    model = ResolvedModel(name, ConfigFacts.of(real), digest, lora, search_limit, config)
    if key is not None:
        cache.store(key, model)
    return model


def model_states(
    config: Any,
    dtype: torch.dtype,
    trainable: str,
    optimizer: str,
    cluster: Cluster,
    lora: Lora | None = None,
    cache: FitCache | None = None,
) -> ModelStates:
    """The whole model's parameter counts, from a fake copy of the trained model (LoRA applied as ``lora`` says, by
    default PEFT's default targets at rank 8) with fewer layers; kept in ``cache`` (and in this process) with the
    closed forms."""
    digest = hashlib.sha256(config.to_json_string().encode()).hexdigest()
    model = ResolvedModel("", ConfigFacts.of(config), digest, lora, SEARCH_LIMIT, lambda: config)
    return _model_states(model, dtype, trainable, optimizer, cluster, lora, cache)


def _model_states(
    model: ResolvedModel,
    dtype: torch.dtype,
    trainable: str,
    optimizer: str,
    cluster: Cluster,
    lora: Lora | None,
    cache: FitCache | None,
) -> ModelStates:
    """:func:`model_states` of a resolved model."""
    threshold = cluster.deepspeed.param_persistence_threshold
    key = ("states", model.digest, str(dtype), trainable, optimizer, lora, threshold)
    cache = cache or FitCache(enabled=False)
    if key not in _CLOSED_FORMS:
        states = cache.load(cache.key(key))
        if states is None:

            def prepare(fake: nn.Module, session: FakeSession) -> nn.Module:
                return with_lora(fake, session, lora) if trainable == "lora" else fake

            config = model.config()
            fake = StepProfiler(config, prepare, dtype, 1, optimizer).model(PROFILE_LAYERS[0])
            states = ModelStates.of(fake, model.facts.num_hidden_layers, optimizer == "adamw", threshold)
            cache.store(cache.key(key), states)
        _CLOSED_FORMS[key] = states
    return _CLOSED_FORMS[key]


def rank_budget(
    gpu_bytes: int,
    host_bytes: int | None,
    pinned_bytes: int | None,
    reserve: int,
    host_reserve: int,
    cluster: Cluster,
    ranked: RankStates | None,
) -> Budget:
    """One rank's budget: the GPU's memory less ``reserve``; its share of the node's host memory less
    ``host_reserve``; its share of what may be pinned less DeepSpeed's pinned states (``ranked``)."""
    if reserve >= gpu_bytes:
        raise ValueError(f"reserve ({format_bytes(reserve)}) must be less than gpu_memory ({format_bytes(gpu_bytes)})")
    if host_bytes is not None and host_reserve >= host_bytes:
        raise ValueError(
            f"host_reserve ({format_bytes(host_reserve)}) must be less than host_memory ({format_bytes(host_bytes)})"
        )
    ranks = cluster.ranks_per_node
    pinned = None
    if pinned_bytes is not None:
        pinned = max(pinned_bytes / ranks - (ranked.host_pinned if ranked else 0), 0.0)
    host = None if host_bytes is None else (host_bytes - host_reserve) / ranks
    return Budget(float(gpu_bytes - reserve), host, pinned)


# -- command line --------------------------------------------------------------------------------------


def add_parser(parser: argparse.ArgumentParser) -> None:
    def error(message: str) -> None:  # one line, like every other bad input
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]
    parser.add_argument(
        "--model",
        required=True,
        help=f"built-in model ({', '.join(SHAPE_NAMES)}), a path to a config.json (or its folder), or a Hugging "
        "Face Hub id such as meta-llama/Meta-Llama-3-8B (from the local cache; the Hub unless HF_HUB_OFFLINE=1)",
    )
    parser.add_argument(
        "--seq-len",
        default="32k",
        help="tokens per sequence, e.g. 32768, 128k or 1M (default 32k; the search for the longest starts there)",
    )
    parser.add_argument("--gpu-memory", required=True, help="memory of one GPU, e.g. 80GiB or 80GB")
    parser.add_argument(
        "--host-memory",
        default=None,
        help="host memory per node of the training machine for offloaded tensors, e.g. 1TiB (default: THIS "
        "machine's RAM, with a warning)",
    )
    parser.add_argument(
        "--reserve",
        default=f"{DEVICE_RESERVE // GiB}GiB",
        help="memory of each GPU the step may not use: CUDA context and cuBLAS workspace (~0.6 GiB), NCCL "
        f"buffers (~1 GiB), allocator fragmentation (~1.4 GiB) (default {DEVICE_RESERVE // GiB}GiB)",
    )
    parser.add_argument(
        "--host-reserve",
        default=None,
        help="host memory per node the ranks may not use: the OS and the processes (default "
        f"{HOST_RESERVE_NODE // GiB}GiB + {HOST_RESERVE_PER_RANK // GiB}GiB per GPU of the node)",
    )
    parser.add_argument(
        "--pinned-memory",
        default=None,
        help="host memory per node that may be pinned (default: "
        f"{PINNABLE_FRACTION:.0%}% of what the host reserve leaves)",  # argparse reads %%: a literal %
    )
    parser.add_argument(
        "--gpu", default=DEFAULT_GPU, help=f"GPU of the step-time bound: {', '.join(GPUS)} (default {DEFAULT_GPU})"
    )
    parser.add_argument("--batch", default="1", help="sequences per step (default 1)")
    parser.add_argument("--trainable", default="full", help="full (default) or lora")
    parser.add_argument("--lora-rank", default=None, help=f"rank of the LoRA adapters (default {LORA_RANK})")
    parser.add_argument(
        "--lora-targets",
        default=None,
        help="modules LoRA adapts, comma-separated, e.g. q_proj,k_proj,v_proj,o_proj (default: PEFT's default "
        "targets for the model type; q_proj,v_proj for Llama)",
    )
    parser.add_argument(
        "--trainable-modules",
        default=None,
        help="modules trained in full beside the LoRA adapters (PEFT's modules_to_save), comma-separated, e.g. "
        "embed_tokens,norm (default none)",
    )
    parser.add_argument("--optimizer", default="adamw", help="adamw (default) or none")
    parser.add_argument("--num-gpus", default="1", help="GPUs of the job (default 1)")
    parser.add_argument("--gpus-per-node", default="8", help="GPUs sharing one node's host memory (default 8)")
    parser.add_argument(
        "--sequence-parallel", default="1", help="Ulysses sequence-parallel degree K, dividing --num-gpus (default 1)"
    )
    parser.add_argument("--zero", default="0", help="ZeRO stage: 0 (default), 1, 2 or 3")
    parser.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="DeepSpeed offload_optimizer: master weights, fp32 gradients and AdamW moments on the host",
    )
    parser.add_argument(
        "--pure-bf16",
        action="store_true",
        help="DeepSpeed with bf16 master weights, gradients and AdamW moments (bf16_master_weights_and_grads, "
        "bf16_optimizer_states); default: fp32 ones (bf16 mixed precision)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, of: {', '.join(CURRENT_MODES)} (default: {','.join(DEFAULT_MODES)}); none, full, "
        "selective and memo are MemoConfig(recompute=...)'s modes, hf and hf-checkpointing plain Hugging Face without "
        "and with its gradient checkpointing; the old names vanilla (hf) and minseq still work, with a deprecation "
        "note",
    )
    parser.add_argument("--dtype", default="bf16", help="parameter dtype: bf16 (default), fp16 or fp32")
    parser.add_argument(
        "--jobs",
        default=None,
        help="processes that profile side by side (default: one per CPU this process may use, at most 8)",
    )
    parser.add_argument("--no-search", action="store_true", help="skip the search for the longest sequence")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="fit every closed form again instead of reading (and writing) the on-disk cache of fits "
        f"(${CACHE_ENV}, default {cache_dir()}); the answer is the same",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", default=None, help="write a memory timeline PNG of each mode here")
    parser.add_argument("--trace-dir", default=None, help="write each mode's allocation trace here as JSON lines")


def cluster_of(args: argparse.Namespace) -> Cluster:
    """The :class:`Cluster` the command line's flags describe; errors name the flag and its accepted values."""
    num_gpus = positive_int("--num-gpus", args.num_gpus)
    per_node = positive_int("--gpus-per-node", args.gpus_per_node)
    sp = positive_int("--sequence-parallel", args.sequence_parallel)
    if num_gpus % sp:
        raise ValueError(f"--sequence-parallel must divide --num-gpus ({num_gpus}), got {args.sequence_parallel!r}")
    zero = int(choice("--zero", args.zero, ["0", "1", "2", "3"]))
    if zero == 0 and (args.offload_optimizer or args.pure_bf16):
        raise ValueError("--offload-optimizer and --pure-bf16 are DeepSpeed ZeRO settings: they need --zero 1, 2 or 3")
    return Cluster(num_gpus, sp, zero, args.offload_optimizer, per_node, DeepSpeedConfig(pure_bf16=args.pure_bf16))


def memory_of(args: argparse.Namespace, cluster: Cluster) -> dict[str, int]:
    """The command line's memory sizes (``estimate``'s keyword arguments), its defaults filled in; errors name
    the flags."""
    gpu = parse("--gpu-memory", parse_bytes, args.gpu_memory)
    host = (
        psutil.virtual_memory().total
        if args.host_memory is None
        else parse("--host-memory", parse_bytes, args.host_memory)
    )
    reserve = parse("--reserve", parse_bytes, args.reserve)
    default_host_reserve = HOST_RESERVE_NODE + HOST_RESERVE_PER_RANK * cluster.ranks_per_node
    host_reserve = (
        default_host_reserve if args.host_reserve is None else parse("--host-reserve", parse_bytes, args.host_reserve)
    )
    if reserve >= gpu:
        raise ValueError(f"--reserve ({format_bytes(reserve)}) must be less than --gpu-memory ({format_bytes(gpu)})")
    if host_reserve >= host:
        raise ValueError(
            f"--host-reserve ({format_bytes(host_reserve)}) must be less than --host-memory ({format_bytes(host)})"
        )
    pinned = (
        int(PINNABLE_FRACTION * (host - host_reserve))
        if args.pinned_memory is None
        else parse("--pinned-memory", parse_bytes, args.pinned_memory)
    )
    return {
        "gpu_memory": gpu,
        "host_memory": host,
        "pinned_memory": pinned,
        "reserve": reserve,
        "host_reserve": host_reserve,
    }


def lora_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's LoRA settings (``estimate``'s keyword arguments); errors name the flags."""
    given = [
        flag
        for flag, value in (
            ("--lora-rank", args.lora_rank),
            ("--lora-targets", args.lora_targets),
            ("--trainable-modules", args.trainable_modules),
        )
        if value is not None
    ]
    if given and args.trainable != "lora":
        raise ValueError(f"{', '.join(given)}: only with --trainable lora")
    if args.lora_targets is not None and not args.lora_targets.strip(","):
        raise ValueError("--lora-targets must name at least one module, e.g. q_proj,v_proj")
    return {
        "lora_rank": None if args.lora_rank is None else positive_int("--lora-rank", args.lora_rank),
        "lora_targets": args.lora_targets,
        "trainable_modules": args.trainable_modules,
    }


def run(args: argparse.Namespace) -> int:
    modes, notes = resolve_modes([m.strip() for m in args.modes.split(",") if m.strip()], "--modes")
    if not modes:
        raise ValueError(f"--modes must name at least one of {', '.join(CURRENT_MODES)}, got {args.modes!r}")
    for note in notes:
        print(f"hf-memo estimate: warning: {note}", file=sys.stderr)
    cluster = cluster_of(args)
    with warnings.catch_warnings():  # each deprecated name was said above, once
        warnings.filterwarnings("ignore", "mode .* is deprecated", FutureWarning)
        result = estimate(
            args.model,
            parse("--seq-len", parse_tokens, args.seq_len),
            batch_size=positive_int("--batch", args.batch),
            trainable=choice("--trainable", args.trainable, TRAINABLE),
            **lora_flags(args),
            optimizer=choice("--optimizer", args.optimizer, OPTIMIZERS),
            modes=modes,
            dtype=DTYPES[choice("--dtype", args.dtype, list(DTYPES))],
            search=not args.no_search,
            keep_traces=bool(args.plot or args.trace_dir),
            gpu=choice("--gpu", args.gpu.lower(), list(GPUS)),
            cluster=cluster,
            workers=None if args.jobs is None else positive_int("--jobs", args.jobs),
            cache=not args.no_cache,
            **memory_of(args, cluster),
        )
    result.host_memory_source = HOST_FROM_FLAG if args.host_memory is not None else HOST_FROM_THIS_MACHINE
    if args.trace_dir:
        folder = Path(args.trace_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for mode, trace in result.traces.items():
            trace.save(folder / f"{mode}.jsonl")
    if args.plot:
        shape = f"{result.layers} layers, {result.dtype}, batch {result.batch_size} x {result.seq_len:,} tokens"
        title = f"{result.model}, {shape}: device memory over one training step"
        plot_timelines(result.traces, args.plot, title, result.gpu_memory)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        if args.host_memory is None:  # stdout stays JSON (host_memory_source says it); the warning goes to stderr
            for line in this_machine_warning(result.host_memory):
                print(f"hf-memo estimate: warning: {line}", file=sys.stderr)
    else:
        print(result.table())
        if args.trace_dir:
            print(f"\nTraces: {', '.join(str(Path(args.trace_dir) / f'{m}.jsonl') for m in result.traces)}")
        if args.plot:
            print(f"Timeline plot: {args.plot}")
    return 0
