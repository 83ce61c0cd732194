"""One configuration of the suite in its own process: build the model, patch it, train, measure.

    python -m benchmarks.suite.worker JOB.json RESULT.json

``JOB.json`` holds a :class:`Job`; ``RESULT.json`` receives ``{"status", "reason", "metrics", "env"}``
with status ``"ok"``, ``"device_oom"`` (out of device memory; in a dry run, over the emulated
capacity), ``"pinned_oom"`` (pinning host memory failed), ``"host_oom"`` (out of host memory),
``"error"`` (any other exception, with the end of its traceback) or ``"unavailable"`` (an optional
package or feature is missing here); see :func:`classify`. A process that dies without writing the
result is recorded by the runner: as ``"host_oom"`` when it was killed by SIGKILL (the kernel's
OOM killer), else as an error.

The environment variable ``BENCH_SUITE_FAULT`` (``device_oom``, ``pinned_oom``, ``host_oom``,
``killed``, ``error`` or ``exit``) injects that fault right before the first training step, to check
how the suite records it.
"""

from __future__ import annotations

import inspect
import json
import linecache
import os
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from benchmarks.suite import baselines
from benchmarks.suite.contenders import ALLOC_CONF, Contender, contender, memo_config_kwargs
from benchmarks.suite.metrics import mfu
from benchmarks.suite.store import DEVICE_OOM, HOST_OOM, PINNED_OOM
from benchmarks.suite.workloads import LORA_TARGETS, Workload, workload
from hf_memo import memo_runtime
from hf_memo.integrations.flops import FlopModel
from hf_memo.profiler.allocations import AllocationRecorder
from hf_memo.profiler.analysis import peak

FAULT_VARIABLE = "BENCH_SUITE_FAULT"
_REASON_CHARS = 3000  # of a traceback, kept in the results
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, ids (B, S), labels (B, S)) -> ()


class Unavailable(Exception):
    """The contender cannot run in this environment (an optional package or feature is missing)."""


@dataclass(frozen=True)
class Job:
    """One run: a workload trained with a contender at one sequence length.

    Attributes:
        timed: after a warm-up step, time up to ``max_timed_steps`` steps (at least
            ``min_measure_s`` seconds of them when the time allows); otherwise a probe: one step
            with steady-state memory (optimizer state allocated first), to learn whether it fits.
        time_limit_s: seconds this process may use; timed steps stop early to stay inside it.
        dry_run_scale: how much shorter the dry run's sequences are than the real ones.
        peak_flops: the device's peak FLOP/s for MFU, or ``None``.
    """

    workload: str
    contender: str
    seq_len: int
    timed: bool
    dry_run: bool
    dry_run_scale: int
    max_timed_steps: int
    min_measure_s: float
    time_limit_s: float
    peak_flops: float | None


def _versions(names: tuple[str, ...]) -> dict[str, str]:
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def environment(device: torch.device) -> dict[str, Any]:
    """Where this ran: device name, memory and package versions."""
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "packages": _versions(("torch", "transformers", "peft", "hf-memo", "liger-kernel", "deepspeed", "triton")),
        ALLOC_CONF: os.environ.get(ALLOC_CONF),  # set per contender by the runner; shapes fragmentation
    }
    if device.type == "cuda":
        env["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        env["cuda"] = torch.version.cuda
    return env


def build_model(spec: Workload, dry_run: bool, device: torch.device) -> nn.Module:
    """The workload's ``LlamaForCausalLM`` with random weights, built directly on ``device``, in train mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**spec.config_kwargs(dry_run))
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    return model.train()


def enable_checkpointing(causal_lm: nn.Module, mode: str) -> None:
    """Hugging Face activation checkpointing of every decoder layer; ``mode="offload"`` keeps checkpoints on the host.

    Offloading pins host memory even when the model is on the CPU, so it needs a pinned-memory
    allocator (a CUDA build of torch with a GPU); without one it is unavailable. Transformers
    before 5.23 name the method ``gradient_checkpointing_enable``.
    """
    enable = getattr(causal_lm, "activation_checkpointing_enable", None) or causal_lm.gradient_checkpointing_enable
    if mode == "offload":
        import transformers

        if "offload" not in inspect.signature(enable).parameters:
            raise Unavailable(f"transformers {transformers.__version__}: {enable.__name__} has no offload argument")
        try:
            torch.empty(1, pin_memory=True)
        except RuntimeError as error:
            raise Unavailable(f"Hugging Face's checkpoint offload pins host memory: {error}") from error
    enable(offload=mode == "offload")


def prepare(entry: Contender, spec: Workload, job: Job, device: torch.device) -> tuple[nn.Module, LossFn]:
    """The model patched as ``entry`` says, and the function that computes its training loss."""
    causal_lm = build_model(spec, job.dry_run, device)
    loss_fn: LossFn = _hf_loss
    try:
        if entry.patch == "liger-flce":
            baselines.install_liger_fused_linear_cross_entropy()
        elif entry.patch == "deepspeed-tiled":
            baselines.install_deepspeed_tiled_mlp(causal_lm)
            loss_fn = _deepspeed_loss
    except ImportError as error:
        raise Unavailable(f"{entry.patch}: {error}") from error
    if entry.checkpointing is not None:
        enable_checkpointing(causal_lm, entry.checkpointing)
    model: nn.Module = causal_lm
    if spec.lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=spec.lora_rank,
            lora_alpha=2 * spec.lora_rank,
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(causal_lm, lora)
    if entry.memo is not None:
        import hf_memo

        hf_memo.apply(model, hf_memo.MemoConfig(**memo_config_kwargs(entry, job.dry_run, job.dry_run_scale)))
    return model, loss_fn


def _hf_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=labels).loss


def _deepspeed_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return baselines.deepspeed_tiled_loss(causal_lm, input_ids, labels)


def prime_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer state with a zero-gradient step, so the first measured step has steady-state memory.

    With zero gradients and no weight decay AdamW leaves the parameters unchanged.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _pin_host_memory() -> None:
    """Stands for ``torch.empty(n, pin_memory=True)`` when ``cudaHostAlloc`` fails: it raises this very error."""
    raise RuntimeError(f"CUDA error: out of memory (injected by {FAULT_VARIABLE}=pinned_oom)")


def _inject_fault() -> None:
    fault = os.environ.get(FAULT_VARIABLE)
    if fault == "device_oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {FAULT_VARIABLE}=device_oom)")
    if fault == "pinned_oom":
        _pin_host_memory()
    if fault == "host_oom":
        raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory (injected by {FAULT_VARIABLE}=host_oom)")
    if fault == "killed":
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer ends a process
    if fault == "error":
        raise RuntimeError(f"injected by {FAULT_VARIABLE}=error")
    if fault == "exit":
        os._exit(3)


class TrainingSteps:
    """Training steps of one prepared model on fixed ``input_ids`` ``(1, S)`` (also the labels).

    Each step is synchronised with the device, so wall-clock times are device times. AdamW over
    the trainable parameters, its state allocated up front (:func:`prime_optimizer`).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, input_ids: torch.Tensor, device: torch.device) -> None:
        self.model, self.loss_fn, self.input_ids, self.device = model, loss_fn, input_ids, device
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=0.0)
        prime_optimizer(self.optimizer)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> tuple[float, float]:
        """One forward, backward and optimizer step; ``(seconds, loss)``."""
        self._sync()
        start = time.perf_counter()
        loss = self.loss_fn(self.model, self.input_ids, self.input_ids)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        self._sync()
        return time.perf_counter() - start, value

    def resident_tensors(self) -> list[torch.Tensor]:
        """Parameters, buffers, optimizer state and inputs: what lives across steps."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return [*self.model.parameters(), *self.model.buffers(), *state, self.input_ids]


def _counted_step(steps: TrainingSteps) -> tuple[float, float, int]:
    """One step under hf_memo's allocation recorder: ``(seconds, loss, peak)``, the peak of the bytes that stand
    for device memory (host-offloaded buffers are not counted, as on a GPU)."""
    recorder = AllocationRecorder(lambda: "other", lambda: "other")
    with recorder:
        recorder.track(steps.resident_tensors(), "parameter")
        seconds, loss = steps.step()
    return seconds, loss, peak(recorder.trace(), "device").total


def _memory_metrics(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    metrics = {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "num_ooms": stats.get("num_ooms", 0),
    }
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        metrics["pinned_peak_bytes"] = host_stats().get("allocated_bytes.peak")
    return metrics


def run(job: Job, metrics: dict[str, Any]) -> None:
    """Run ``job``, filling ``metrics`` as it goes (so an out-of-memory error still leaves what was measured)."""
    started = time.perf_counter()
    spec, entry = workload(job.workload), contender(job.contender)
    device = torch.device("cpu" if job.dry_run else "cuda")
    if job.dry_run:
        torch.set_num_threads(1)  # tiny models gain nothing from threads, and spinning threads stall a shared CPU
    model, loss_fn = prepare(entry, spec, job, device)
    config = spec.config_kwargs(job.dry_run)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, config["vocab_size"], (1, job.seq_len), generator=generator).to(device)
    steps = TrainingSteps(model, loss_fn, input_ids, device)
    flop_model = FlopModel.of(model)
    flops = flop_model.flops(job.seq_len, job.seq_len**2)  # one sample per row, no padding
    metrics.update(
        flops_per_step=flops,
        flop_model=asdict(flop_model),
        peak_flops=job.peak_flops,
        memory_source="storage count (CPU)" if job.dry_run else "cuda allocator",
    )
    process = psutil.Process()
    metrics["host_rss_before_bytes"] = process.memory_info().rss
    if device.type == "cuda":  # peaks and counters cover the training steps, not the model's construction
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
        if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()
    _inject_fault()

    if job.dry_run:
        first_s, loss, peak = _counted_step(steps)
        metrics["peak_allocated_bytes"] = peak
        if peak > spec.dry_run_capacity:
            raise torch.OutOfMemoryError(
                f"dry run: step peak {peak} bytes exceeds the emulated capacity of {spec.dry_run_capacity} bytes"
            )
    else:
        first_s, loss = steps.step()
    metrics.update(first_step_s=first_s, loss=loss)  # warm-up: calibration, planning, pinning; never a step time
    stop_at = started + 0.9 * job.time_limit_s
    times: list[float] = []
    while job.timed and len(times) < job.max_timed_steps:
        last = times[-1] if times else first_s
        if time.perf_counter() + 1.2 * last > stop_at or (times and sum(times) >= job.min_measure_s):
            break
        times.append(steps.step()[0])
    metrics.update(_memory_metrics(device))
    runtime = memo_runtime(model)
    if runtime is not None:  # registered with cudaHostRegister (plain memory on CPU): not in PyTorch's pinned stats
        metrics["memo_host_bytes"] = runtime.host_reserved_bytes
    metrics["host_rss_after_bytes"] = process.memory_info().rss
    metrics["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if times:
        step_s = statistics.median(times)
        metrics.update(
            step_times_s=times,
            step_s=step_s,
            tokens_per_s=job.seq_len / step_s,
            mfu=mfu(flops, step_s, job.peak_flops),
        )


def _statement(frame: traceback.FrameSummary) -> str:
    """The source of the statement a frame was running, every line of it (a call spread over several lines)."""
    last = getattr(frame, "end_lineno", None) or frame.lineno  # Python >= 3.11 knows where the statement ends
    return "".join(linecache.getline(frame.filename, line) for line in range(frame.lineno, last + 1))


def classify(error: BaseException) -> str:
    """The status of a failed run: ``"pinned_oom"``, ``"host_oom"``, ``"device_oom"`` or ``"error"``.

    PyTorch reports a failed ``cudaHostAlloc`` (pinned memory) as ``RuntimeError("CUDA error: out of
    memory")``, like some device allocations, so a failure is a pinning one when its message or the
    statement of the innermost frame of its traceback names pinning (``torch.empty(...,
    pin_memory=True)`` as in ``torch.autograd.graph.save_on_cpu``, ``tensor.pin_memory()``, hf_memo's
    ``cudaHostRegister``). Host memory: ``MemoryError`` or the CPU allocator's message. Device memory:
    ``torch.OutOfMemoryError`` (the caching allocator, and the dry run's emulated capacity), any other
    CUDA out-of-memory message, or cuBLAS failing to allocate.
    """
    text = str(error)
    frames = traceback.extract_tb(error.__traceback__)
    innermost = f"{frames[-1].name} {_statement(frames[-1])}" if frames else ""
    pinning = "pin_memory" in innermost or "_pin_" in innermost
    if "cudaHostAlloc" in text or "cudaHostRegister" in text or (pinning and "out of memory" in text):
        return PINNED_OOM
    if isinstance(error, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in text:
        return HOST_OOM
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text:
        return DEVICE_OOM
    return "error"


def execute(job: Job) -> dict[str, Any]:
    """Run ``job`` and classify the outcome; never raises."""
    metrics: dict[str, Any] = {}
    device = torch.device("cpu" if job.dry_run else "cuda")
    try:
        run(job, metrics)
        status, reason = "ok", None
    except Unavailable as error:
        status, reason = "unavailable", str(error)
    except Exception as error:
        status = classify(error)
        reason = (
            traceback.format_exc() if status == "error" else "".join(traceback.format_exception_only(error)).strip()
        )
        reason = reason[-_REASON_CHARS:]
        metrics.update(_memory_metrics(device))
    return {"status": status, "reason": reason, "metrics": metrics, "env": environment(device)}


def main(argv: list[str]) -> None:
    job_path, result_path = (Path(p) for p in argv)
    job = Job(**json.loads(job_path.read_text()))
    result = execute(job)
    result["job"] = asdict(job)
    result_path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
