"""``hf_memo.estimate``: peak memory of a training step per mode and the longest sequence that fits.

Every setup ("mode", see :mod:`hf_memo.estimator.setups`) is profiled on fake tensors, so any model is estimated
on a CPU without its weights: a few fresh profiles at short lengths fix a closed form of its peak memory in the
step's sizes (:mod:`hf_memo.estimator.fitted`), and every length, the longest that fits among them, is read off the
closed form. The profiles of all modes are independent and run side by side, one worker process per CPU
(:mod:`hf_memo.profiler.workers`); fits are kept in this process and on disk (:mod:`hf_memo.estimator.fit_cache`).
Bytes the profile finds on the host (offloaded tensors) count as host memory, everything else as device memory.
The memo mode runs the memory-policy solver on its closed form (:mod:`hf_memo.estimator.memo_policy`): its longest
sequence is the longest for which some policy fits the device, the host and the pinned memory. Multi-GPU jobs
(:mod:`hf_memo.estimator.cluster`) are one rank's profile at ``S / K`` tokens with its share of the model states
(:mod:`hf_memo.estimator.model_states`). Step times are bounds (:mod:`hf_memo.estimator.time_model`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from hf_memo.estimator import fit_cache as fits
from hf_memo.estimator.cluster import Cluster, all_to_all_bytes
from hf_memo.estimator.fit_cache import FitCache
from hf_memo.estimator.fitted import BASE_CHUNKS, FittedFootprint, ProfilePlan
from hf_memo.estimator.memo_policy import MemoModel
from hf_memo.estimator.model_states import (
    ModelStates,
    _model_states,
    rank_budget,
    rank_peak,
    rank_state_bytes,
    rank_states,
)
from hf_memo.estimator.question import Budget, ResolvedModel, resolve_model
from hf_memo.estimator.report import Estimate, ModeEstimate
from hf_memo.estimator.setups import (
    AUTO_CHUNKS,
    CURRENT_MODES,
    DEFAULT_MODES,
    MODES,
    TRAINABLE,
    Chunks,
    Lora,
    choice,
    dtype_name,
    memo_with_offload,
    memo_with_policy,
    resolve_modes,
    torch_dtype,
    with_lora,
)
from hf_memo.estimator.time_model import (
    DEFAULT_GPU,
    Gpu,
    ModelFacts,
    attention_imbalance,
    gpu_of,
    model_flops,
    step_seconds,
)
from hf_memo.parallel.heads import check_head_counts
from hf_memo.planner.policy import MemoryPolicy
from hf_memo.profiler.analysis import Peak
from hf_memo.profiler.footprint import Footprint, StepProfiler
from hf_memo.profiler.search import longest_fitting
from hf_memo.profiler.step import OPTIMIZERS
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.profiler.workers import run_side_by_side, usable_cpus
from hf_memo.units import parse_bytes, parse_tokens

if TYPE_CHECKING:  # PyTorch loads with the first profile: an answer read off cached closed forms needs it not
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from hf_memo.profiler.fake_model import FakeSession


SCAN = 0.02  # past the bisection's answer, lengths up to this fraction longer are checked too (chunk rows vary)


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


class _Job:
    """What every mode of one question shares: the model, the ranks, the budgets and the profilers' settings."""

    def __init__(
        self,
        model: ResolvedModel,
        dtype: str | torch.dtype,
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
        self.dtype_name = dtype_name(dtype)
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
            torch_dtype(self.dtype),
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
        highest moment is chosen with them (:func:`~hf_memo.estimator.cluster.rank_state_bytes`)."""
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
    if key not in fits.PROCESS_FITS:
        form = cache.load(cache.key(key))
        if form is None:
            return False
        fits.PROCESS_FITS[key] = form
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
        fits.PROCESS_FITS[job.key(mode)] = form = job.closed_form(mode, by_mode[mode])
        cache.store(cache.key(job.key(mode)), form)
    return {mode: job.bind(fits.PROCESS_FITS[job.key(mode)]) for mode in modes}


def estimate(
    model_or_config: str | PretrainedConfig | nn.Module,
    seq_len: int | str,
    gpu_memory: int | str = "80GiB",
    host_memory: int | str | None = None,
    batch_size: int = 1,
    trainable: str = "full",
    optimizer: str = "adamw",
    modes: Sequence[str] = DEFAULT_MODES,
    dtype: str | torch.dtype = "bf16",
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
        dtype: parameter dtype, a name of :data:`~hf_memo.estimator.setups.DTYPES` (``"bf16"``) or a PyTorch dtype.
        search: also find the longest ``S`` (a multiple of 256) that fits ``gpu_memory`` (and the host and pinned
            memory); for memo, the longest for which some memory policy fits.
        keep_traces: keep each mode's full-depth allocation trace at ``seq_len`` (one rank's tokens) in
            ``Estimate.traces`` (memo: its smallest MEMO policy). A full-depth profile: slow for long sequences.
        progress: show a progress bar.
        gpu: the GPU whose peak FLOP/s and host bandwidth bound the step time (``"h100"``, ``"h200"``, ``"a100"``).
        cluster: ranks, sequence parallelism, ZeRO stage and optimizer offload (default: one GPU).
        pinned_memory: host memory per node that may be pinned (DeepSpeed's pinned offloaded states and memo's
            stashes); default: no limit beyond ``host_memory``. The command line's default is
            :data:`~hf_memo.estimator.cluster.PINNABLE_FRACTION` of the host memory left after the reserve.
        workers: processes that run the profiles side by side (default: one per CPU this process may use, at most
            :data:`MAX_WORKERS`; the answer does not depend on it).
        reserve: bytes of each GPU the step may not use (CUDA context, NCCL, fragmentation); default none (the
            command line's is :data:`~hf_memo.estimator.cluster.DEVICE_RESERVE`).
        host_reserve: bytes of each node's host memory its ranks may not use (OS, processes); default none.
        lora_rank: the rank of the LoRA adapters (default 8); only with ``trainable="lora"``.
        lora_targets: the modules LoRA adapts, a sequence or a comma-separated string of names (default: PEFT's
            default targets for the model type, e.g. ``q_proj, v_proj`` for Llama); only with ``trainable="lora"``.
        trainable_modules: modules trained in full beside the adapters (PEFT's ``modules_to_save``), e.g.
            ``"embed_tokens,norm"``; only with ``trainable="lora"``.
        cache: read and write fitted closed forms in the on-disk cache (:mod:`~hf_memo.estimator.fit_cache`;
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
