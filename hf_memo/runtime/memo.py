"""``MemoRuntime``: the memo executor's per-model state — offload plan per shape, host pool, copy streams, buffers."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import psutil
import torch

from hf_memo.config import MemoConfig
from hf_memo.planner.plan import MemoryPlan
from hf_memo.runtime.alpha import OffloadPlan, quantise, solve_offload_fraction
from hf_memo.runtime.arena import Arena, ArenaWarning
from hf_memo.runtime.calibration import host_bandwidth, layer_bytes_per_token, layer_forward_seconds
from hf_memo.runtime.executor import LayerSplit
from hf_memo.runtime.offload import CopyEngine, HostPool
from hf_memo.runtime.stash import DeviceSlots, LayerStash

AUTO_HOST_FRACTION = 0.5  # of the RAM available when the runtime is created


class _Transport:
    """Per-device copy engine, host pool, rounding buffers and prefetch buffers (from ``arena`` if planned)."""

    def __init__(self, device: torch.device, arena: Arena | None) -> None:
        self.engine = CopyEngine(device)
        self.pool = HostPool(device)
        self.rounding = DeviceSlots("rounding", device, self.engine, arena)
        self.prefetch = DeviceSlots("prefetch", device, self.engine, arena)


class MemoRuntime:
    """State shared by the decoder layers of one model under ``recompute="memo"``.

    Attributes:
        attention_calls: attention forwards run by the executor (attention is never recomputed).
        plan: the offload plan of the most recent layer shape.
        memory_plan: the memory plan whose arena serves the rounding and prefetch buffers (``planner`` on).

    Args:
        planner: ``planner(batch_size, seq_len)`` makes a memory plan for a step of that shape; called
            on the first step of a shape the attached plan was not made for (``config.planner`` on).
    """

    def __init__(
        self, config: MemoConfig, num_layers: int, planner: Callable[[int, int], MemoryPlan] | None = None
    ) -> None:
        self.config = config
        self.num_layers = num_layers
        self.memory_plan: MemoryPlan | None = None
        self._planner = planner
        limit = config.host_memory_limit_bytes
        self.host_limit = limit if limit is not None else int(AUTO_HOST_FRACTION * psutil.virtual_memory().available)
        self.attention_calls = 0
        self.plan: OffloadPlan | None = None
        self._plans: dict[tuple, OffloadPlan] = {}
        self._head_offloaded: dict[tuple, bool] = {}
        self._bandwidth: dict[torch.device, float] = {}
        self._transports: dict[torch.device, _Transport] = {}
        self._latest: dict[int, LayerStash] = {}

    # -- offload plan ---------------------------------------------------------------------------------
    def alpha_chunks(self, split: LayerSplit, x: torch.Tensor, chunks: int) -> int:
        """Chunks (of ``chunks``) whose tokens are offloaded for a layer input ``x`` ``(B, S, H)``."""
        key = _shape_key(x)
        if key not in self._plans:
            if self.config.planner != "off":
                self._plan_memory(x.shape[0], x.shape[1])
            fixed, other = layer_bytes_per_token(split, x)
            tokens = x.shape[0] * x.shape[1]
            plan = self._plans[key] = self._solve(split, x, fixed, other)
            host_bytes = plan.swapped_layers * (fixed + plan.alpha * other) * tokens
            self._head_offloaded[key] = host_bytes + x.numel() * x.element_size() <= self.host_limit
        self.plan = self._plans[key]
        return quantise(self.plan.alpha, chunks)

    def _solve(self, split: LayerSplit, x: torch.Tensor, fixed: float, other: float) -> OffloadPlan:
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

    # -- memory plan --------------------------------------------------------------------------------------
    def attach_memory_plan(self, plan: MemoryPlan | None) -> None:
        """Serve the rounding and prefetch buffers from an arena laid out by ``plan`` (``None``: the allocator)."""
        self.memory_plan = plan
        for device, transport in self._transports.items():
            transport.rounding.arena = transport.prefetch.arena = None if plan is None else Arena(plan, device)

    def _plan_memory(self, batch_size: int, seq_len: int) -> None:
        if _made_for(self.memory_plan, batch_size, seq_len):
            return
        if self._planner is None:
            warnings.warn(
                f"no memory plan for batch {batch_size} x {seq_len} tokens; buffers come from the caching allocator",
                ArenaWarning,
                stacklevel=3,
            )
            self.attach_memory_plan(None)
        else:
            self.attach_memory_plan(self._planner(batch_size, seq_len))

    # -- stashes (the executor's StashSource) ---------------------------------------------------------
    def _transport(self, device: torch.device) -> _Transport:
        if device not in self._transports:
            arena = None if self.memory_plan is None else Arena(self.memory_plan, device)
            self._transports[device] = _Transport(device, arena)
        return self._transports[device]

    def open_stash(self, index: int, device: torch.device) -> LayerStash:
        transport = self._transport(device)
        swapped = self.plan is not None and index < self.plan.swapped_layers
        return LayerStash(index, swapped, transport.engine, transport.pool, transport.rounding, transport.prefetch)

    def open_head_stash(self, hidden: torch.Tensor) -> LayerStash | None:
        """A swapped stash for the LM head's input ``hidden`` ``(B, S, H)``, or ``None`` to keep it on the device.

        ``None`` when no layer of that shape has run yet or when the host limit has no room for it
        beside the layers' offloaded bytes. It uses the rounding and prefetch buffers of an
        imaginary layer ``n`` (layer ``n - 2``, which shares its buffers, is never swapped).
        """
        if not self._head_offloaded.get(_shape_key(hidden), False):
            return None
        transport = self._transport(hidden.device)
        return LayerStash(
            self.num_layers, True, transport.engine, transport.pool, transport.rounding, transport.prefetch
        )

    def sealed(self, index: int, stash: LayerStash) -> None:
        self._latest[index] = stash

    def backward_started(self, index: int, device: torch.device) -> None:
        if index == self.num_layers - 1:
            self._transport(device).rounding.release_all()
        below = self._latest.get(index - 1)
        if below is not None:
            below.prefetch()

    def backward_done(self, index: int, device: torch.device) -> None:
        if index == 0:
            self._transport(device).prefetch.release_all()

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


def _shape_key(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.dtype, x.device


def _made_for(plan: MemoryPlan | None, batch_size: int, seq_len: int) -> bool:
    """Whether ``plan`` was made for steps of ``batch_size`` sequences of ``seq_len`` tokens."""
    return plan is not None and (plan.meta.get("batch_size"), plan.meta.get("seq_len")) == (batch_size, seq_len)
