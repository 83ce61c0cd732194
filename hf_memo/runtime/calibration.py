"""Measurements the offload LP needs: bytes per token of a layer, its forward time, host bandwidth."""

from __future__ import annotations

import time

import torch

from hf_memo.runtime.attention_core import LocalAttention, attention_forward
from hf_memo.runtime.executor import LayerSplit, MemoLayerFunction
from hf_memo.runtime.offload import CopyEngine, HostPool
from hf_memo.runtime.stash import DeviceSlots, LayerStash


class _ProbeRuntime:
    """A stash source that keeps one unswapped stash, for measuring what a layer saves."""

    def __init__(self, device: torch.device) -> None:
        engine = CopyEngine(device)
        self.stash = LayerStash(
            0,
            False,
            engine,
            HostPool(device),
            DeviceSlots("probe", device, engine),
            DeviceSlots("probe", device, engine),
        )

    def open_stash(self, index: int, device: torch.device) -> LayerStash:
        return self.stash

    def sealed(self, index: int, stash: LayerStash) -> None:
        pass

    def backward_started(self, index: int, device: torch.device) -> None:
        pass

    def backward_done(self, index: int, device: torch.device) -> None:
        pass

    def attention_ran(self) -> None:
        pass


def layer_bytes_per_token(split: LayerSplit, x: torch.Tensor, rows: int = 256) -> tuple[float, float]:
    """``(S_in + S_attn, S_other)`` per token of one layer, from running it on the first ``rows`` tokens.

    Args:
        x: ``(B, S, H)`` the layer's input; the probe runs on ``x[:, :rows]`` with every token
            offloaded and counts the distinct bytes saved. RNG state is left untouched.

    Returns:
        bytes per token (``B * 1`` tokens) of the layer input plus attention output and statistics,
        and of every other saved activation.
    """
    rows = min(rows, x.shape[1])
    probe = _ProbeRuntime(x.device)
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=x.device.type), torch.enable_grad():
        q, _, _ = split.project(x[:, :1].detach(), 0, 1)
        MemoLayerFunction.apply(
            probe, split, LocalAttention, 0, [(0, rows)], 1, x[:, :rows].detach().clone().requires_grad_(True)
        )
    stat_size = 8 if q.dtype == torch.float64 else 4
    heads, head_dim = q.shape[1], q.shape[-1]
    fixed = x.shape[-1] * x.element_size() + heads * head_dim * q.element_size() + heads * stat_size
    tokens = x.shape[0] * rows
    return fixed, max(probe.stash.raw_nbytes / tokens - fixed, 0.0)


def layer_forward_seconds(split: LayerSplit, x: torch.Tensor) -> float:
    """Wall seconds of one forward of the layer on ``x`` ``(B, S, H)`` without a graph (synchronised on CUDA).

    RNG state is left untouched.
    """
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=x.device.type), torch.no_grad():
        _synchronize(x.device)
        start = time.perf_counter()
        q, k, v = split.project(x, 0, x.shape[1])
        out, _ = attention_forward(q, k, v, split.scale)
        split.finish(x, out.transpose(1, 2).reshape(*x.shape[:2], -1))
        _synchronize(x.device)
        return time.perf_counter() - start


def host_bandwidth(x: torch.Tensor, pool: HostPool) -> float:
    """Bytes per second of copying ``x`` to a host buffer of ``pool`` (pinned on CUDA), as offloading will.

    The buffer goes back to the pool, where the layer's stash reuses it: measuring costs no memory.
    """
    nbytes = x.numel() * x.element_size()
    host = pool.acquire(nbytes)
    flat = x.detach().reshape(-1).view(torch.uint8)
    try:
        _synchronize(x.device)
        start = time.perf_counter()
        host[:nbytes].copy_(flat, non_blocking=True)
        _synchronize(x.device)
        return nbytes / max(time.perf_counter() - start, 1e-9)
    finally:
        pool.release(host)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
