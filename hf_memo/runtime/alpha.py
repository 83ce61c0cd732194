"""MEMO's offload fraction: how many tokens' activations to offload instead of recomputing.

For ``n`` layers of which ``n - 2`` are swapped, with per-layer bytes ``S_in`` (layer input),
``S_attn`` (attention output and statistics) and ``S_other`` (every other saved activation, all
tokens), host bandwidth ``B``, one layer's forward time ``T``, host memory ``M`` and a device budget
``D``, MEMO solves::

    maximise alpha  s.t.  (S_in + S_attn + alpha * S_other) / B <= T          (copies hide behind compute)
                          (n - 2) * (S_in + S_attn + alpha * S_other) <= M    (the host holds them)
                          (2 + 2) * (S_in + S_attn + alpha * S_other) <= D    (the device holds its share)
                          0 <= alpha <= 1

The device holds, at its fullest, the stashes of the two unswapped top layers and two of a swapped layer's
stash (its tensors while they are copied out at the end of forward; in backward, the prefetch buffers of the
layer running and the one below it). A one-variable LP: the answer is the smallest of the bounds, clipped to
[0, 1], then rounded down to the executor's grid of whole mini-sequence chunks (what runs is what the plan
says). When even ``S_in + S_attn`` of every swapped layer does not fit in ``M``, only as many layers
are swapped as fit and the rest keep their activations on the device (they count for ``D`` too). When no
layer is swapped (two layers or fewer, or a host too small for one), nothing is copied: only ``D`` bounds
alpha, or the request.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadPlan:
    """The solved offload: fraction of tokens offloaded, and how many of the lowest layers are swapped."""

    alpha: float
    swapped_layers: int
    bound: str  # which constraint decided alpha: "bandwidth", "host memory", "device memory", "requested" or "all"
    # ("host memory" only with a swapped layer: the host bytes it names are never 0)


def solve_offload_fraction(
    num_layers: int,
    fixed_bytes: float,
    other_bytes: float,
    host_limit: float,
    bandwidth: float | None = None,
    layer_time: float | None = None,
    requested: float | None = None,
    device_budget: float | None = None,
    chunks: int | None = None,
) -> OffloadPlan:
    """Solve MEMO's LP for one layer shape.

    Args:
        num_layers: decoder layers ``n``; the last two are never swapped.
        fixed_bytes: ``S_in + S_attn`` of one layer (always offloaded for swapped layers).
        other_bytes: ``S_other`` of one layer at ``alpha = 1``.
        host_limit: host bytes offloading may use, ``M``.
        bandwidth: device<->host bytes per second ``B``; with ``layer_time``, the copy constraint.
        layer_time: seconds one layer's forward takes, ``T``.
        requested: a fixed alpha asked for by the user; only lowered (with a warning) if the host
            or the device cannot hold it.
        device_budget: device bytes the layers' stashes and the copy buffers may use, ``D``; ``None``
            for no limit.
        chunks: the executor's mini-sequence chunks per layer: alpha is rounded down to whole chunks
            (``None``: not rounded).
    """
    candidates = max(num_layers - 2, 0)
    swapped = candidates if fixed_bytes <= 0 else min(candidates, int(host_limit // fixed_bytes))
    if swapped < candidates:
        warnings.warn(
            f"host memory limit {host_limit / 2**30:.1f} GiB holds the layer inputs and attention outputs of "
            f"{swapped} of {candidates} layers; the other {candidates - swapped} keep them on the device",
            stacklevel=2,
        )
    if other_bytes <= 0:  # nothing to choose: every saved activation is in S_in + S_attn
        return OffloadPlan(1.0, swapped, "all")
    on_device = num_layers - swapped + (2 if swapped else 0)  # resident layers' stashes + two copy buffers if any
    bounds = {}
    if swapped:
        bounds["host memory"] = (host_limit / swapped - fixed_bytes) / other_bytes
    if device_budget is not None:
        bounds["device memory"] = (device_budget / on_device - fixed_bytes) / other_bytes
        if bounds["device memory"] < 0:
            warnings.warn(
                f"the device budget of {device_budget / 2**30:.2f} GiB cannot hold the layer inputs and attention "
                f"outputs the device keeps ({on_device} x {fixed_bytes / 2**30:.2f} GiB); the step may run out of "
                "device memory (MemoConfig.device_memory_limit)",
                stacklevel=2,
            )
    if requested is not None:
        bound, limit = min(bounds.items(), key=lambda item: item[1], default=("requested", 1.0))
        if limit < requested:
            warnings.warn(
                f"offload_fraction={requested} needs more {bound} than the limit allows; using {max(limit, 0.0):.3f}",
                stacklevel=2,
            )
            return OffloadPlan(_on_grid(max(limit, 0.0), chunks), swapped, bound)
        return OffloadPlan(_on_grid(min(requested, 1.0), chunks), swapped, "requested")
    if swapped and bandwidth is not None and layer_time is not None:
        bounds["bandwidth"] = (bandwidth * layer_time - fixed_bytes) / other_bytes
    bound, alpha = min(bounds.items(), key=lambda item: item[1], default=("all", 1.0))
    if alpha >= 1.0:
        return OffloadPlan(1.0, swapped, "all")
    return OffloadPlan(_on_grid(max(alpha, 0.0), chunks), swapped, bound)


def _on_grid(alpha: float, chunks: int | None) -> float:
    """``alpha`` rounded down to whole chunks of ``chunks`` (as is, for ``None``)."""
    return alpha if chunks is None else quantise(alpha, chunks) / chunks


def quantise(alpha: float, chunks: int) -> int:
    """Whole mini-sequence chunks covered by ``alpha`` (rounded down, so no constraint is exceeded)."""
    return min(chunks, math.floor(alpha * chunks + 1e-9))
