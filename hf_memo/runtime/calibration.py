"""Measurements the memory policy needs: bytes per token of a layer (input, attention, the rest), its forward time
(and its attention core's share) and memory, host bandwidth."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.minseq.grads import summing_dtype
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.executor import (  # the executor's own layout steps, so the timed pattern is its pattern
    AttentionCore,
    LayerSplit,
    MemoLayerFunction,
    _HeadRows,
    _sequence_major,
)
from hf_memo.runtime.offload import HostPool, copy_engine
from hf_memo.runtime.stash import DeviceSlots, LayerStash

GRID_STEPS = 8  # measured times and bandwidths are rounded to powers of 2 ** (1 / GRID_STEPS): steps of 9%
TIMED_RUNS = 3  # a timing is the fastest of this many runs (the least disturbed by other work on the machine)


def snapped(value: float) -> float:
    """``value`` (> 0) rounded to the nearest power of ``2 ** (1 / GRID_STEPS)``: a measurement as the memory policy
    uses it, so that run-to-run noise of a few percent rarely changes a decision (e.g. 0.93 s and 0.95 s both give
    0.917 s)."""
    return 2.0 ** (round(math.log2(value) * GRID_STEPS) / GRID_STEPS) if value > 0 else value


class _ProbeRuntime:
    """A stash source that keeps one unswapped stash, for measuring what a layer saves."""

    def __init__(self, device: torch.device) -> None:
        engine = copy_engine(device)
        self.stash = LayerStash(
            0,
            False,
            engine,
            HostPool(device),
            DeviceSlots("probe", device, engine),
        )

    def open_stash(self, index: int, device: torch.device) -> LayerStash:
        return self.stash

    def sealed(self, index: int, stash: LayerStash) -> None:
        pass

    def fetch_below(self, stash: LayerStash, nbytes: int | None) -> None:
        pass

    def backward_done(self, stash: LayerStash, device: torch.device) -> None:
        pass

    def attention_ran(self) -> None:
        pass


def _stashed_bytes(split: LayerSplit, x: torch.Tensor, rows: int) -> int:
    """Distinct bytes the layer stashes running on ``x[:, :rows]`` with every token offloaded."""
    probe = _ProbeRuntime(x.device)
    MemoLayerFunction.apply(
        probe, split, LocalAttention, 0, [(0, rows)], 1, x[:, :rows].detach().clone().requires_grad_(True)
    )
    return probe.stash.raw_nbytes


@dataclass(frozen=True)
class LayerBytes:
    """Bytes per token (``B * 1`` tokens) one layer keeps for its backward.

    Attributes:
        input: ``S_in``, the layer input ``(B, S, H)``.
        attention: ``S_attn``, the attention output ``(B, S, h*D)`` and softmax statistics ``(B, h, S)``.
        other: ``S_other``, every other saved activation (at ``alpha = 1``).
        key_sums: the running sums of the keys' and values' gradients a blocked backward keeps (and gives back
            chunk by chunk), ``h_kv (D_k + D_v)`` elements in the summing dtype (float32 for half inputs).
        output: of ``attention``, the attention output ``(B, S, h*D_v)`` alone (a blocked backward reads it one chunk
            of rows at a time).
    """

    input: float
    attention: float
    other: float
    key_sums: float = 0.0
    output: float = 0.0

    @property
    def fixed(self) -> float:
        """``S_in + S_attn``: what a layer keeping its attention keeps of every token."""
        return self.input + self.attention


def layer_bytes_per_token(split: LayerSplit, x: torch.Tensor, rows: int = 256) -> LayerBytes:
    """What one layer keeps per token, from running it on two prefixes of ``x``.

    Args:
        x: ``(B, S, H)`` the layer's input; the probe runs on ``x[:, :rows]`` and ``x[:, :rows // 2]``
            with every token offloaded and counts the distinct bytes saved. Per-token bytes are the
            difference divided by the difference in tokens, so a tensor whose size does not depend on
            the tokens (e.g. a weight cast under autocast) never counts as per-token. RNG state is left
            untouched.
    """
    long = min(rows, x.shape[1])
    short = long // 2
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=x.device.type), torch.enable_grad():
        q, k, v = split.project(x[:, :1].detach(), 0, 1)
        saved = _stashed_bytes(split, x, long)
        if short > 0:
            per_token = (saved - _stashed_bytes(split, x, short)) / (x.shape[0] * (long - short))
        else:  # a one-token sequence: one prefix is all there is
            per_token = saved / x.shape[0]
    stat_size = 8 if q.dtype == torch.float64 else 4
    heads, head_dim = q.shape[1], q.shape[-1]
    kept = LayerBytes(x.shape[-1] * x.element_size(), heads * head_dim * q.element_size() + heads * stat_size, 0.0)
    sums = k.shape[1] * (k.shape[-1] + v.shape[-1]) * summing_dtype(k.dtype).itemsize
    output = heads * v.shape[-1] * q.element_size()
    return LayerBytes(kept.input, kept.attention, max(per_token - kept.fixed, 0.0), sums, output)


@dataclass(frozen=True)
class LayerForward:
    """One layer forward as the executor runs it: wall ``seconds``, of which ``attention_seconds`` in the
    attention core (what an X-only layer repeats in backward), and the device bytes it needed above its
    input (``workspace_bytes``, peak minus what was allocated before; 0 on CPU, which has no counter)."""

    seconds: float
    workspace_bytes: int
    attention_seconds: float


class _Clock:
    """Marks points of a run; :meth:`seconds` gives the time between consecutive marks (CUDA events on CUDA,
    read once the run is done; ``perf_counter`` on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.points: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))  # the model's device, whichever is current
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if self.cuda:
            self.points[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.points, self.points[1:])]
        return [b - a for a, b in zip(self.points, self.points[1:])]


def _chunked_forward(
    split: LayerSplit, x: torch.Tensor, bounds: list[tuple[int, int]], core: AttentionCore, clock: _Clock | None = None
) -> torch.Tensor:
    """The executor's forward pattern: project per chunk, attention over the sequence, finish per chunk.
    ``clock`` (if any) is marked at the start, around the attention core, and at the end."""
    mark = (lambda: None) if clock is None else clock.mark
    mark()
    rows = _HeadRows(x.shape[1])
    for start, stop in bounds:
        rows.write(start, stop, split.project(x[:, start:stop], start, stop))
    q, k, v = rows.tensors
    del rows
    mark()
    out, _ = core.forward(q, k, v, split.traits)
    mark()
    del q, k, v
    o_rows = _sequence_major(out).transpose(1, 2).reshape(*x.shape[:2], -1)
    del out
    y = None
    for start, stop in bounds:
        y_rows = split.finish(x[:, start:stop], o_rows[:, start:stop], start)
        if y is None:
            y = y_rows.new_empty((*x.shape[:2], y_rows.shape[-1]))
        y[:, start:stop] = y_rows
    mark()
    return y


class PeakAllocated(TorchDispatchMode):
    """The highest ``read()`` (e.g. ``torch.cuda.memory_allocated``) seen after any op run while active, as
    :attr:`peak`: the tensor-level peak of a computation, measured without resetting the allocator's own peak
    counter (which the Trainer's memory metrics and users' measurements read). Scratch memory an op frees before
    it returns is not seen."""

    def __init__(self, read: Callable[[], int]) -> None:
        super().__init__()
        self.read = read
        self.peak = read()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.read())
        return out


def time_layer_forward(
    split: LayerSplit, x: torch.Tensor, bounds: list[tuple[int, int]], core: AttentionCore = LocalAttention
) -> LayerForward:
    """Time one forward of the layer on ``x`` ``(B, S, H)`` as the executor runs it, without a graph.

    The sequence is cut at ``bounds`` (the executor's chunks: no full-length MLP intermediate ever
    exists) and attention runs through ``core`` (under sequence parallelism, the core that exchanges
    heads for the sequence: the all-to-alls are timed too, and every rank of the group must call this
    together). A first, untimed call warms up kernels, workspaces and caches, and on CUDA measures the peak
    device memory above what was allocated before (:class:`PeakAllocated`: the allocator's peak counter is
    not reset); the second is timed with CUDA events on CUDA (``perf_counter`` on CPU), as a whole and its
    attention core alone; of :data:`TIMED_RUNS` timed calls, the fastest counts. RNG state is left untouched.
    """
    cuda = x.device.type == "cuda"
    devices = [x.device] if cuda else []
    with torch.random.fork_rng(devices=devices, device_type=x.device.type), torch.no_grad():
        workspace = 0
        if cuda:
            base = torch.cuda.memory_allocated(x.device)
            with PeakAllocated(lambda: torch.cuda.memory_allocated(x.device)) as peak:
                _chunked_forward(split, x, bounds, core)
            workspace = peak.peak - base
        else:
            _chunked_forward(split, x, bounds, core)
        runs = []
        for _ in range(TIMED_RUNS):
            clock = _Clock(x.device)
            _chunked_forward(split, x, bounds, core, clock)
            runs.append(clock.seconds())
        pre, attention, post = min(runs, key=sum)
        return LayerForward(pre + attention + post, workspace, attention)


def layer_forward_seconds(split: LayerSplit, x: torch.Tensor, chunk_tokens: int = 1024) -> float:
    """Seconds of one warm forward of the layer on ``x`` ``(B, S, H)`` in chunks of at most ``chunk_tokens``
    rows (the default is ``MemoConfig.min_chunk_tokens``'s), timed as :func:`time_layer_forward` does."""
    chunks = -(-x.shape[1] // chunk_tokens)
    return time_layer_forward(split, x, chunk_bounds(x.shape[1], chunks)).seconds


def host_bandwidth(x: torch.Tensor, pool: HostPool) -> float:
    """Bytes per second of copying ``x`` to a host buffer of ``pool`` (pinned on CUDA), as offloading will.

    The buffer goes back to the pool, where the layer's stash reuses it: measuring costs no memory. Of
    :data:`TIMED_RUNS` copies, the fastest counts.
    """
    nbytes = x.numel() * x.element_size()
    host = pool.acquire(nbytes)
    flat = x.detach().reshape(-1).view(torch.uint8)
    try:
        seconds = []
        for _ in range(TIMED_RUNS):
            _synchronize(x.device)
            start = time.perf_counter()
            host[:nbytes].copy_(flat, non_blocking=True)
            _synchronize(x.device)
            seconds.append(time.perf_counter() - start)
        return nbytes / max(min(seconds), 1e-9)
    finally:
        pool.release(host)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
