"""Profiling on a CUDA GPU: the allocator's own malloc/free trace, one layer's forward time, pinned copy bandwidth.

The trace comes from ``torch.cuda.memory._record_memory_history`` / ``_snapshot()``: its ``alloc``
and ``free_requested`` entries (``free_completed`` when requests were not recorded) are paired by
address into the same events the fake-tensor profiler writes. Phases and categories come from an
:class:`AllocationRecorder` running alongside, matched by address and size; allocations it cannot
see (kernel workspaces, temporaries inside an op) keep the phase of the allocation before them and
count as temporaries. Layer time and bandwidth are the inputs of MEMO's offload-fraction LP.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from hf_memo.profiler.allocations import StorageTag
from hf_memo.profiler.phases import decoder_layers
from hf_memo.profiler.step import record_training_step, token_batch
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace

_FREES = ("free_requested", "free_completed")


@dataclass(frozen=True)
class OffloadInputs:
    """Measured inputs of the offload-fraction LP: one decoder layer's forward time and pinned copy bandwidth."""

    layer_forward_seconds: float
    host_to_device_bytes_per_second: float
    device_to_host_bytes_per_second: float


def allocated_blocks(snapshot: dict[str, Any], device: int = 0) -> list[tuple[int, int]]:
    """``(address, requested bytes)`` of every block allocated on ``device`` when ``snapshot`` was taken."""
    return [
        (block["address"], block.get("requested_size", block["size"]))
        for segment in snapshot.get("segments", [])
        if segment.get("device", 0) == device
        for block in segment.get("blocks", [])
        if block.get("state") == "active_allocated"
    ]


def trace_from_snapshot(
    snapshot: dict[str, Any],
    device: int = 0,
    tags: Sequence[StorageTag] = (),
    initial_blocks: Iterable[tuple[int, int]] = (),
    meta: dict[str, Any] | None = None,
) -> AllocationTrace:
    """MEMO events from a CUDA memory snapshot's allocator trace (``snapshot["device_traces"][device]``).

    Args:
        snapshot: the dict ``torch.cuda.memory._snapshot()`` returns, recorded with history.
        device: which device's trace to read.
        tags: the recorder's view of the same run (:meth:`AllocationRecorder.storage_tags`), matched to
            ``alloc`` entries by address and size, in order.
        initial_blocks: ``(address, bytes)`` allocated before recording began (see
            :func:`allocated_blocks`): they open the trace as mallocs of phase ``"other"``.
        meta: stored in the trace; ``live_at_end`` (ids never freed) and ``unmatched_frees`` (frees of
            blocks allocated before recording, not in ``initial_blocks``) are added.
    """
    entries = snapshot["device_traces"][device] if device < len(snapshot.get("device_traces", [])) else []
    free_action = "free_requested" if any(e["action"] == "free_requested" for e in entries) else "free_completed"
    waiting: dict[tuple[int, int], deque[StorageTag]] = defaultdict(deque)
    for tag in tags:
        waiting[(tag.address, tag.size)].append(tag)
    events: list[AllocationEvent] = []
    open_blocks: dict[int, AllocationEvent] = {}
    ids = itertools.count()
    unmatched_frees = 0

    def malloc(address: int, size: int, phase: str) -> None:
        queue = waiting.get((address, size))
        tag = queue.popleft() if queue else None
        tensor_id = next(ids)
        if tag is None:
            event = AllocationEvent("malloc", tensor_id, size, phase, "temporary", "device")
        else:
            event = AllocationEvent("malloc", tensor_id, size, tag.phase, tag.category, tag.location, tag.name)
        open_blocks[address] = event
        events.append(event)

    for address, size in initial_blocks:
        malloc(address, size, "other")
    for index, entry in enumerate(entries):
        action = entry["action"]
        if action == "alloc":
            if entry["addr"] in open_blocks:
                raise ValueError(f"trace entry {index}: alloc at {entry['addr']:#x}, which is already allocated")
            malloc(entry["addr"], entry["size"], events[-1].phase if events else "other")
        elif action == free_action:
            opened = open_blocks.pop(entry["addr"], None)
            if opened is None:
                unmatched_frees += 1
                continue
            events.append(replace(opened, op="free", phase=events[-1].phase))
    info = {"live_at_end": sorted(e.tensor_id for e in open_blocks.values()), "unmatched_frees": unmatched_frees}
    return AllocationTrace(events, {**(meta or {}), **info})


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA GPU and none is available; on CPU use the fake-tensor profiler "
            "(hf_memo.profiler.step.trace_training_step or hf_memo.estimate)"
        )


def cuda_training_step_trace(
    model: nn.Module, batch_size: int, seq_len: int, optimizer: str = "adamw", meta: dict[str, Any] | None = None
) -> AllocationTrace:
    """The CUDA allocator's trace of one training step of ``model`` (on a GPU), tagged like the fake profile.

    Blocks allocated when the step starts (weights, optimizer state, inputs) open the trace.
    """
    _require_cuda("cuda_training_step_trace")
    device = next(model.parameters()).device
    index = device.index if device.index is not None else torch.cuda.current_device()
    initial: list[tuple[int, int]] = []

    def start() -> None:
        torch.cuda.synchronize(device)
        initial.extend(allocated_blocks(torch.cuda.memory._snapshot(device), index))
        torch.cuda.memory._record_memory_history("all", context=None, device=device, clear_history=True)

    try:
        recorder, layers = record_training_step(model, batch_size, seq_len, optimizer, start)
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    info = {"batch_size": batch_size, "seq_len": seq_len, "optimizer": optimizer, "layers": layers, "source": "cuda"}
    return trace_from_snapshot(snapshot, index, recorder.storage_tags(), initial, {**info, **(meta or {})})


class _Captured(Exception):
    pass


def _first_layer_call(model: nn.Module, batch_size: int, seq_len: int) -> tuple[nn.Module, tuple, dict]:
    """The first decoder layer and the arguments the model calls it with on ``(batch_size, seq_len)`` tokens."""
    layer = decoder_layers(model)[0]
    captured: dict[str, Any] = {}

    def capture(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.update(args=args, kwargs=kwargs)
        raise _Captured

    handle = layer.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model(input_ids=token_batch(model, batch_size, seq_len))
    except _Captured:
        pass
    finally:
        handle.remove()
    return layer, captured["args"], captured["kwargs"]


def _cuda_seconds(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` on the current stream over ``repeats`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return statistics.median(times)


def layer_forward_seconds(model: nn.Module, seq_len: int, batch_size: int = 1, repeats: int = 5) -> float:
    """Median seconds of one decoder layer's forward on ``(batch_size, seq_len)`` tokens (model on a GPU)."""
    _require_cuda("layer_forward_seconds")
    with torch.no_grad():
        layer, args, kwargs = _first_layer_call(model, batch_size, seq_len)
        return _cuda_seconds(lambda: layer(*args, **kwargs), repeats)


def pinned_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> tuple[float, float]:
    """Measured ``(host->device, device->host)`` bytes/s of copies between pinned host memory and the GPU."""
    _require_cuda("pinned_bandwidth")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    to_device = _cuda_seconds(lambda: device.copy_(host, non_blocking=True), repeats)
    to_host = _cuda_seconds(lambda: host.copy_(device, non_blocking=True), repeats)
    return nbytes / to_device, nbytes / to_host


def offload_inputs(model: nn.Module, seq_len: int, batch_size: int = 1) -> OffloadInputs:
    """Layer forward time of ``model`` (on a GPU) at ``(batch_size, seq_len)`` and the pinned copy bandwidth."""
    _require_cuda("offload_inputs")
    seconds = layer_forward_seconds(model, seq_len, batch_size)
    to_device, to_host = pinned_bandwidth()
    return OffloadInputs(seconds, to_device, to_host)
