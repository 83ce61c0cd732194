"""``MemoRuntime``: the memo executor's per-model state — offload plan per shape, host pool, copy streams, buffers."""

from __future__ import annotations

import psutil
import torch

from hf_memo.config import MemoConfig
from hf_memo.runtime.alpha import OffloadPlan, quantise, solve_offload_fraction
from hf_memo.runtime.calibration import host_bandwidth, layer_bytes_per_token, layer_forward_seconds
from hf_memo.runtime.executor import LayerSplit
from hf_memo.runtime.offload import CopyEngine, HostPool
from hf_memo.runtime.stash import DeviceSlots, LayerStash

AUTO_HOST_FRACTION = 0.5  # of the RAM available when the runtime is created


class _Transport:
    """Per-device copy engine, host pool, rounding buffers and prefetch buffers."""

    def __init__(self, device: torch.device) -> None:
        self.engine = CopyEngine(device)
        self.pool = HostPool(device)
        self.rounding = DeviceSlots("rounding", device, self.engine)
        self.prefetch = DeviceSlots("prefetch", device, self.engine)


class MemoRuntime:
    """State shared by the decoder layers of one model under ``recompute="memo"``.

    Attributes:
        attention_calls: attention forwards run by the executor (attention is never recomputed).
        plan: the offload plan of the most recent layer shape.
    """

    def __init__(self, config: MemoConfig, num_layers: int) -> None:
        self.config = config
        self.num_layers = num_layers
        limit = config.host_memory_limit_bytes
        self.host_limit = limit if limit is not None else int(AUTO_HOST_FRACTION * psutil.virtual_memory().available)
        self.attention_calls = 0
        self.plan: OffloadPlan | None = None
        self._plans: dict[tuple, OffloadPlan] = {}
        self._bandwidth: dict[torch.device, float] = {}
        self._transports: dict[torch.device, _Transport] = {}
        self._latest: dict[int, LayerStash] = {}

    # -- offload plan ---------------------------------------------------------------------------------
    def alpha_chunks(self, split: LayerSplit, x: torch.Tensor, chunks: int) -> int:
        """Chunks (of ``chunks``) whose tokens are offloaded for a layer input ``x`` ``(B, S, H)``."""
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in self._plans:
            self._plans[key] = self._solve(split, x)
        self.plan = self._plans[key]
        return quantise(self.plan.alpha, chunks)

    def _solve(self, split: LayerSplit, x: torch.Tensor) -> OffloadPlan:
        fixed, other = layer_bytes_per_token(split, x)
        tokens = x.shape[0] * x.shape[1]
        fraction = self.config.offload_fraction
        if fraction != "auto":
            return solve_offload_fraction(
                self.num_layers, fixed * tokens, other * tokens, self.host_limit, requested=float(fraction)
            )
        if x.device not in self._bandwidth:
            self._bandwidth[x.device] = self.config.host_bandwidth or host_bandwidth(x, self._transport(x.device).pool)
        layer_time = self.config.layer_time or layer_forward_seconds(split, x)
        return solve_offload_fraction(
            self.num_layers,
            fixed * tokens,
            other * tokens,
            self.host_limit,
            bandwidth=self._bandwidth[x.device],
            layer_time=layer_time,
        )

    # -- stashes (the executor's StashSource) ---------------------------------------------------------
    def _transport(self, device: torch.device) -> _Transport:
        if device not in self._transports:
            self._transports[device] = _Transport(device)
        return self._transports[device]

    def open_stash(self, index: int, device: torch.device) -> LayerStash:
        transport = self._transport(device)
        swapped = self.plan is not None and index < self.plan.swapped_layers
        return LayerStash(index, swapped, transport.engine, transport.pool, transport.rounding, transport.prefetch)

    def sealed(self, index: int, stash: LayerStash) -> None:
        self._latest[index] = stash

    def prefetch_below(self, index: int) -> None:
        below = self._latest.get(index - 1)
        if below is not None:
            below.prefetch()

    def attention_ran(self) -> None:
        self.attention_calls += 1

    # -- statistics -----------------------------------------------------------------------------------
    @property
    def host_reserved_bytes(self) -> int:
        """Host bytes held by the offload pools (reused across steps)."""
        return sum(t.pool.reserved_bytes for t in self._transports.values())

    @property
    def device_buffer_bytes(self) -> int:
        """Device bytes of the rounding and prefetch buffers."""
        return sum(t.rounding.reserved_bytes + t.prefetch.reserved_bytes for t in self._transports.values())
