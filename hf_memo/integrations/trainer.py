"""``MemoCallback``: hf_memo in the Hugging Face ``Trainer`` — patch, plan before the first step, log memory and speed.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[MemoCallback(MemoConfig(recompute="memo", planner="cpsat"))])

When the Trainer is built and when training begins, the callback applies hf_memo with its config if
the model is not patched yet, or checks that the model's patch has that config; it refuses settings
that contradict it (Liger-Kernel). With ``gradient_checkpointing=True`` and a recompute mode, hf_memo's mode
runs the decoder layers instead of Hugging Face checkpointing (see ``hf_memo.patches.hf_checkpointing``).
Under ``recompute="memo"`` with a planner it plans memory for the shape ``(B, S)`` of the first
training batch, on the first training forward (the first moment the shape is known, before any of it
runs), and attaches the plan; the plan is cached in ``<output_dir>/hf_memo_plan.json`` and reused
(on resume, or a rerun) when it was made for the same shape, model config, dtype, trainable
parameters, adapters and hf_memo config. With ``offload_fraction="auto"`` the offload is only known
once the real model has solved it in the first step: the runtime plans for it then, and the callback
caches that plan after the step. Other shapes are planned by the runtime on their first step.

On every training log (the logs that carry ``loss``) it adds, so that the console, TensorBoard,
W&B... receive them:

``hf_memo/device_peak_memory_gib``
    CUDA only: ``torch.cuda.max_memory_allocated`` of this process's device since the previous
    training log (the counter is reset at each log), in GiB.
``hf_memo/process_peak_rss_gib``
    Elsewhere (CPU): the process's peak resident set size since it started (``ru_maxrss``), in GiB:
    everything the process holds, not only tensors, and it never decreases. CPU has no tensor peak
    counter; the fake-tensor profile (``hf-memo estimate``) is the number to compare across setups.
``hf_memo/host_offload_gib``
    Host bytes held by the memo executor's offload pools (reused across steps; on CUDA the bytes really
    pinned), in GiB; 0 for the other recompute modes.
``hf_memo/tokens_per_second``
    Real tokens of every training forward (padding, where the ``attention_mask`` is 0, left out; prompt
    tokens included) of all data-parallel replicas, divided by the training time of the steps since the
    previous log. Training time is wall time from the end of the previous step (or of the evaluation,
    checkpoint or log that followed it) to the end of each step: data loading, forward, backward and
    optimizer step, without evaluation, checkpointing or the one-time planning. Replicas are assumed to
    see batches like this process's; ranks of one sequence-parallel group share their replica's tokens.
``hf_memo/tokens_per_gpu_per_second``
    ``tokens_per_second`` divided by the number of processes (GPUs).
``hf_memo/mfu``
    Model FLOPs utilisation: model FLOPs of the interval over ``training time * peak FLOP/s * processes``.
    Model FLOPs (:mod:`hf_memo.integrations.flops`, shared with the benchmark suite) count, per real
    token, 6 per trainable and 4 per frozen matrix weight (embedding lookups none), plus causal
    attention per sample: ``6 * n * a * Σ s_i**2`` over the samples ``s_i`` of each row (packed rows
    split where ``position_ids`` restart, padding left out). The peak is the ``peak_flops`` given, else
    the bf16 dense tensor-core peak of a known GPU (:data:`~hf_memo.integrations.flops.PEAK_BF16_FLOPS`);
    left out when neither is known (CPU, other GPUs).
``hf_memo/alpha``
    ``recompute="memo"`` only: the mean over the decoder layers of the offload fraction of the memory
    policy in force for the latest layer shape (each layer's ``alpha``: ``memo_runtime(model).plan``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

from hf_memo.config import MemoConfig
from hf_memo.integrations.flops import FlopModel, peak_flops_of, token_counts
from hf_memo.integrations.planning import plan_training_step
from hf_memo.parallel.fsdp import check_parameters_whole
from hf_memo.patches.apply import applied_config, apply, causal_lm_of, memo_runtime
from hf_memo.planner.plan import MemoryPlan

logger = logging.getLogger(__name__)

PLAN_FILE = "hf_memo_plan.json"
FIT_KEY = "fits"  # the plan's meta entry that says what the plan was made for
GiB = 2**30

DEVICE_PEAK = "hf_memo/device_peak_memory_gib"
PROCESS_PEAK_RSS = "hf_memo/process_peak_rss_gib"
HOST_OFFLOAD = "hf_memo/host_offload_gib"
TOKENS_PER_SECOND = "hf_memo/tokens_per_second"
TOKENS_PER_GPU_PER_SECOND = "hf_memo/tokens_per_gpu_per_second"
MFU = "hf_memo/mfu"
ALPHA = "hf_memo/alpha"


def peak_rss_bytes() -> int:
    """The peak resident set size of this process since it started, in bytes."""
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        return int(psutil.Process().memory_info().peak_wset)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def check_training_arguments(args: TrainingArguments, config: MemoConfig) -> None:
    """Refuse ``TrainingArguments`` that contradict ``config`` (``ValueError`` naming both settings)."""
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            "TrainingArguments(use_liger_kernel=True) would patch the MLP and the LM head + loss, which hf_memo "
            "already replaces (its mini-sequence LM head never builds the full logits either). Set "
            "use_liger_kernel=False; for Liger's other kernels call "
            "liger_kernel.transformers.apply_liger_kernel_to_<family>(swiglu=False, cross_entropy=False, "
            "fused_linear_cross_entropy=False) before building the model."
        )


def _config_difference(applied: MemoConfig, wanted: MemoConfig) -> str:
    return ", ".join(
        f"{f.name}={getattr(applied, f.name)!r} (MemoCallback: {getattr(wanted, f.name)!r})"
        for f in dataclasses.fields(MemoConfig)
        if getattr(applied, f.name) != getattr(wanted, f.name)
    )


def _jsonable(value: Any) -> Any:
    return sorted(value, key=str) if isinstance(value, (set, frozenset)) else str(value)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=_jsonable).encode()).hexdigest()[:16]


def world_size() -> int:
    """Processes of the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def plan_fit(model: nn.Module, config: MemoConfig, batch_size: int, seq_len: int) -> dict[str, Any]:
    """What a memory plan for ``model`` on ``(batch_size, seq_len)`` batches depends on (JSON values).

    The shape, digests of the model config, of the names of the trainable parameters and of the PEFT
    adapters' configs, the parameter dtype, the hf_memo config and the number of processes (a shard's length
    and the sharded parameters depend on it).
    """
    target = causal_lm_of(model)
    peft_config = getattr(model, "peft_config", None)
    fit = {
        "batch_size": batch_size,
        "seq_len": seq_len,
        "model_config": _digest(target.config.to_dict()),
        "dtype": str(next(target.parameters()).dtype),
        "trainable": _digest(sorted(name for name, p in model.named_parameters() if p.requires_grad)),
        "adapters": None if peft_config is None else _digest({k: v.to_dict() for k, v in peft_config.items()}),
        "hf_memo_config": config.to_dict(),
        "world_size": world_size(),
    }
    return json.loads(json.dumps(fit))  # as it reads back from the plan file


def _batch_input(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The forward's ``input_ids`` ``(B, S)`` or ``inputs_embeds`` ``(B, S, H)``, if it has one."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    return ids if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None


class MemoCallback(TrainerCallback):
    """hf_memo for the ``Trainer``: patch, plan, refuse contradictions, log memory and speed (see the module docstring).

    Args:
        config: the :class:`MemoConfig` to apply; ``None`` uses the model's if it is already patched,
            else ``MemoConfig()``. A model patched with another config is refused.
        peak_flops: peak FLOP/s of one device for ``hf_memo/mfu``; ``None`` detects known GPUs.
        plan_file: name of the plan cache inside ``output_dir``.
        progress: show the planner's progress bar.

    Attributes:
        plan_path: where the plan was read from or written to (``None`` until one is attached).
        plan_source: ``"planned"`` or ``"reused"`` (from the cache), ``None`` until a plan is attached.

    The Trainer calls the reporting callbacks (TensorBoard, W&B, ...) before the callbacks you pass it;
    the first time the Trainer calls this callback it moves itself right after ``DefaultFlowCallback``,
    so the metrics it adds to the logs reach them.
    """

    def __init__(
        self,
        config: MemoConfig | None = None,
        peak_flops: float | None = None,
        plan_file: str = PLAN_FILE,
        progress: bool = True,
    ) -> None:
        if config is not None and not isinstance(config, MemoConfig):
            raise ValueError(f"MemoCallback config must be a MemoConfig or None, got {type(config).__name__}")
        if peak_flops is not None and not (isinstance(peak_flops, (int, float)) and peak_flops > 0):
            raise ValueError(f"MemoCallback peak_flops must be None or FLOP/s > 0, got {peak_flops!r}")
        self.config = config
        self.peak_flops = peak_flops
        self.plan_file = plan_file
        self.progress = progress
        self.plan_path: Path | None = None
        self.plan_source: str | None = None
        self._model: nn.Module | None = None
        self._args: TrainingArguments | None = None
        self._hook: Any = None
        self._needs_plan = False
        self._plan_to_cache: tuple[Path, dict[str, Any]] | None = None
        self._reset_interval()

    # -- Trainer events ------------------------------------------------------------------------------------
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: nn.Module = None, **kwargs
    ) -> None:
        self._run_before_reporters()
        if model is not None:  # the Trainer's model, wrapped for its engine: refused before any step starts
            check_parameters_whole(model, "the Trainer's model wrapped by FSDP1")
        self._prepare(args, model)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: nn.Module = None, **kwargs
    ) -> None:
        self._run_before_reporters()
        if model is not None:  # the Trainer's model, wrapped for its engine: refused before any step starts
            check_parameters_whole(model, "the Trainer's model wrapped by FSDP1")
        self._prepare(args, model)
        self._start(args, model)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self._plan_to_cache is not None:
            self._cache_runtime_plan(*self._plan_to_cache)
        if control.should_log and args.device.type == "cuda":
            torch.cuda.synchronize(args.device)  # the step's kernels belong to this interval
        now = time.perf_counter()
        self._seconds += now - self._clock
        self._clock = now

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self._clock = time.perf_counter()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self._clock = time.perf_counter()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs,
    ) -> None:
        if logs is not None and "loss" in logs and self._model is not None:
            metrics = self._metrics(args)
            logs.update(metrics)
            latest = state.log_history[-1] if state.log_history else {}
            if latest.get("step") == state.global_step and latest.get("loss") == logs["loss"]:
                latest.update(metrics)  # the Trainer recorded the entry before calling the callbacks
            self._reset_interval()
        self._clock = time.perf_counter()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- patch and checks ----------------------------------------------------------------------------------
    def _run_before_reporters(self) -> None:
        """Put this callback right after ``DefaultFlowCallback`` in the list of the handler calling it."""
        frame = sys._getframe(2)  # this -> the event method -> CallbackHandler.call_event
        for _ in range(3):
            if frame is None:
                return
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler) and any(cb is self for cb in handler.callbacks):
                others = [cb for cb in handler.callbacks if cb is not self]
                flow = [cb for cb in others if isinstance(cb, DefaultFlowCallback)]
                # A new list: the handler keeps iterating the old one for the event under way.
                handler.callbacks = flow + [self] + [cb for cb in others if not isinstance(cb, DefaultFlowCallback)]
                return
            frame = frame.f_back

    def _prepare(self, args: TrainingArguments, model: nn.Module | None) -> None:
        if model is None:
            raise ValueError("MemoCallback needs the Trainer's model; construct the Trainer with model=...")
        applied = applied_config(model)
        if applied is not None and self.config is not None and applied != self.config:
            raise ValueError(
                "the model is already patched by hf_memo with another config: "
                f"{_config_difference(applied, self.config)}. Pass the same MemoConfig, or MemoCallback() without a "
                "config to train with the model's."
            )
        config = applied or self.config or MemoConfig()
        check_training_arguments(args, config)
        if applied is None:
            apply(model, config)

    # -- metrics -------------------------------------------------------------------------------------------
    def _start(self, args: TrainingArguments, model: nn.Module) -> None:
        config = applied_config(model)
        self._model, self._args = model, args
        self._needs_plan = (
            memo_runtime(model) is not None and config.planner != "off" and config.sequence_parallel_size == 1
        )
        self._flop_model = FlopModel.of(model)
        self._world = max(args.world_size, 1)
        self._replicas = max(self._world // config.sequence_parallel_size, 1)
        self._peak_flops = self.peak_flops
        if self._peak_flops is None and args.device.type == "cuda":
            self._peak_flops = peak_flops_of(torch.cuda.get_device_name(args.device))
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        if self._hook is not None:
            self._hook.remove()
        self._hook = model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        self._reset_interval()

    def _reset_interval(self) -> None:
        self._tokens: torch.Tensor | int = 0  # Σ s_i and Σ s_i**2 over the interval's samples (device tensors)
        self._squared_lengths: torch.Tensor | int = 0
        self._seconds = 0.0
        self._excluded = 0.0
        self._clock = time.perf_counter()

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        ids = _batch_input(args, kwargs)
        if ids is None:
            return
        batch_size, seq_len = int(ids.shape[0]), int(ids.shape[1])
        tokens, squared = token_counts(ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
        self._tokens = self._tokens + tokens
        self._squared_lengths = self._squared_lengths + squared
        if self._needs_plan:
            self._needs_plan = False
            began = time.perf_counter()
            self._attach_plan(batch_size, seq_len)
            self._excluded += time.perf_counter() - began

    def _metrics(self, args: TrainingArguments) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if args.device.type == "cuda":
            metrics[DEVICE_PEAK] = torch.cuda.max_memory_allocated(args.device) / GiB
            torch.cuda.reset_peak_memory_stats(args.device)
        else:
            metrics[PROCESS_PEAK_RSS] = peak_rss_bytes() / GiB
        runtime = memo_runtime(self._model)
        metrics[HOST_OFFLOAD] = (runtime.host_reserved_bytes if runtime is not None else 0) / GiB
        seconds = self._seconds - self._excluded
        tokens = int(self._tokens)
        if seconds > 0 and tokens > 0:
            tokens_per_second = tokens * self._replicas / seconds
            metrics[TOKENS_PER_SECOND] = tokens_per_second
            metrics[TOKENS_PER_GPU_PER_SECOND] = tokens_per_second / self._world
            if self._peak_flops is not None:
                flops = self._flop_model.flops(tokens, int(self._squared_lengths))
                metrics[MFU] = flops * self._replicas / (seconds * self._peak_flops * self._world)
        if runtime is not None and runtime.plan is not None:
            metrics[ALPHA] = sum(layer.alpha for layer in runtime.plan.layers) / len(runtime.plan.layers)
        return metrics

    # -- memory plan ---------------------------------------------------------------------------------------
    def _attach_plan(self, batch_size: int, seq_len: int) -> None:
        model, args = self._model, self._args
        fit = plan_fit(model, applied_config(model), batch_size, seq_len)
        path = Path(args.output_dir) / self.plan_file
        plan = self._cached_plan(path, fit)
        source = "reused"
        runtime = memo_runtime(model)
        if plan is None and applied_config(model).offload_fraction == "auto":
            # The offload is solved on the real model in the first step: the runtime plans for it then, and the
            # plan is cached after that step (a plan made now would be for an offload the step may not choose).
            self._plan_to_cache = (path, fit)
            return
        if plan is None:
            device = next(model.parameters()).device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                plan = plan_training_step(model, batch_size, seq_len, progress=self.progress)
            self._save_plan(plan, path, fit)
            source = "planned"
        runtime.attach_memory_plan(plan)
        self.plan_path, self.plan_source = path, source
        logger.info("hf_memo: memory plan for batch %d x %d tokens %s (%s)", batch_size, seq_len, source, path)

    def _cache_runtime_plan(self, path: Path, fit: dict[str, Any]) -> None:
        """Write the plan the runtime made in the first step (for the offload it solved) to the cache."""
        self._plan_to_cache = None
        plan = memo_runtime(self._model).memory_plan
        if plan is None:
            return
        self._save_plan(plan, path, fit)
        self.plan_path, self.plan_source = path, "planned"
        logger.info("hf_memo: memory plan for the offload solved in the first step cached (%s)", path)

    def _save_plan(self, plan: MemoryPlan, path: Path, fit: dict[str, Any]) -> None:
        """Record what ``plan`` fits in its meta and write it atomically to ``path`` (on the saving process)."""
        plan.meta[FIT_KEY] = fit
        if self._args.should_save:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{os.getpid()}")
            plan.save(partial)
            os.replace(partial, path)

    @staticmethod
    def _cached_plan(path: Path, fit: dict[str, Any]) -> MemoryPlan | None:
        if not path.is_file():
            return None
        try:
            plan = MemoryPlan.load(path)
        except ValueError as error:
            warnings.warn(f"{error}; planning again", stacklevel=2)
            return None
        return plan if plan.meta.get(FIT_KEY) == fit else None
