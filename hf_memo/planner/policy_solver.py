"""The per-layer memory policy that minimises the predicted step time within device and host budgets.

Cost model, per decoder layer (all layers have the same shape, so the same costs), with ``stash`` the
bytes the layer keeps (``S_in``, plus ``S_attn`` if it keeps attention, plus ``alpha * S_other``)::

    seconds = T_f + T_b + (1 - alpha) * T_other + (0 if keep_attention else T_attn)        (compute)
              + max(0, stash / B - T_f)                                                (host layers only)
              + max(0, (stash - late) / B - (T_b + recompute)) + late / B

The last terms are the copy to the host in forward and back in backward, minus what hides behind the
layer's own compute. In backward, the layer above fetches the stash ahead only as far as its freed
key-gradient sums make room (``ahead``; the attention output a blocked backward reads one chunk of rows at
a time, beside its compute, is not part of that fetch); the rest, ``late = max(0, stash - streamed -
ahead)``, is fetched when the layer's own backward begins and waited on at once: exposed. The step time is
the sum over the layers. Memory::

    device = sum of device layers' stashes + 2 * the largest host layer's stash   (rounding or prefetch buffers)
    host   = sum of host layers' stashes

The top two layers' stashes are needed first in backward, so they stay on the device.

Exact solve: the layers are identical, so a policy is fixed by how many layers of each kind there are
(X+attention or X only, host or device) and the alphas of each kind. Per layer, the time is convex in
alpha and the bytes are linear in it, so within one kind the best alphas for a given sum differ by at
most one grid step (balanced), and across host kinds the best use of host bytes takes alpha steps in
order of their time saved (a greedy over sorted convex marginals). On the device, every alpha step
saves the same ``T_other / steps``. Enumerating the kind counts and the size of the copy buffers
(the largest host stash, one of ``2 * (steps + 1)`` values) then covers every policy; the solve takes
``O(n² · steps · (n + steps))`` steps. Tests check it against brute force over all per-layer assignments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_memo.planner.policy import LayerPolicy, MemoryPolicy


@dataclass(frozen=True)
class LayerCosts:
    """Bytes and seconds of one decoder layer at one step shape ``(B, S)``.

    Attributes:
        input_bytes: ``S_in``, the layer input ``(B, S, H)``.
        attention_bytes: ``S_attn``, the attention output ``(B, S, h*D)`` and its statistics ``(B, h, S)``.
        other_bytes: ``S_other``, every other activation backward needs, for all tokens (``alpha = 1``).
        forward_seconds: ``T_f``, the layer's forward.
        backward_seconds: ``T_b``, the layer's backward without any recompute.
        attention_seconds: ``T_attn``, the attention forward a layer keeping ``X`` only recomputes in backward.
        other_seconds: ``T_other``, the rest of the forward, recomputed for the ``1 - alpha`` of the tokens.
        ahead_bytes: of a host layer's stash, the bytes the backward of the layer above fetches while it runs: the
            bytes of the keys' gradient sums it frees chunk by chunk (its blocked backward), ``inf`` where the
            stash is fetched whole ahead (a backward not in blocks, or planned memory).
        streamed_bytes: of ``attention_bytes``, the attention output a blocked backward of a layer keeping it
            reads from the host one chunk of rows at a time while it runs (0 where the output is fetched whole).
    """

    input_bytes: float
    attention_bytes: float
    other_bytes: float
    forward_seconds: float
    backward_seconds: float
    attention_seconds: float
    other_seconds: float
    ahead_bytes: float = math.inf
    streamed_bytes: float = 0.0

    def stash_bytes(self, keep_attention: bool, alpha: float) -> float:
        """Bytes a layer keeps for backward."""
        return self.input_bytes + (self.attention_bytes if keep_attention else 0.0) + alpha * self.other_bytes

    def recompute_seconds(self, keep_attention: bool, alpha: float) -> float:
        """Seconds the layer's backward spends recomputing what it did not keep."""
        return (1.0 - alpha) * self.other_seconds + (0.0 if keep_attention else self.attention_seconds)

    def late_bytes(self, keep_attention: bool, alpha: float) -> float:
        """Bytes of a host layer's stash fetched only when its own backward begins, and waited on at once: what
        the layer above's backward did not fetch ahead (``ahead_bytes``), the streamed attention output aside."""
        fetched = self.stash_bytes(keep_attention, alpha) - (self.streamed_bytes if keep_attention else 0.0)
        return max(0.0, fetched - self.ahead_bytes)

    def layer_seconds(self, layer: LayerPolicy, bandwidth: float) -> float:
        """Predicted seconds of the layer's forward and backward under ``layer``, copies included."""
        recompute = self.recompute_seconds(layer.keep_attention, layer.alpha)
        seconds = self.forward_seconds + self.backward_seconds + recompute
        if layer.on_host:
            stash = self.stash_bytes(layer.keep_attention, layer.alpha)
            late = self.late_bytes(layer.keep_attention, layer.alpha)
            seconds += max(0.0, stash / bandwidth - self.forward_seconds)
            seconds += max(0.0, (stash - late) / bandwidth - self.backward_seconds - recompute) + late / bandwidth
        return seconds


class PolicyDoesNotFit(ValueError):
    """Not even the smallest policy (``X`` only, alpha 0) fits; ``device_shortfall``/``host_shortfall`` in bytes."""

    def __init__(self, message: str, device_shortfall: float, host_shortfall: float) -> None:
        super().__init__(message)
        self.device_shortfall = device_shortfall
        self.host_shortfall = host_shortfall


def fetch_split(blocked: bool, key_sums_bytes: float, output_bytes: float) -> dict[str, float]:
    """``LayerCosts``' ``ahead_bytes`` and ``streamed_bytes`` of a layer: where its backward runs in blocks (and
    memory is not planned), the layer above's backward fetches ahead as many bytes as its keys' gradient sums
    (``key_sums_bytes``) give back, and a kept attention output (``output_bytes``) is read one chunk of rows at a
    time; elsewhere the whole stash is fetched ahead."""
    if not blocked:
        return {"ahead_bytes": math.inf, "streamed_bytes": 0.0}
    return {"ahead_bytes": float(key_sums_bytes), "streamed_bytes": float(output_bytes)}


def policy_memory(layers: tuple[LayerPolicy, ...], costs: LayerCosts) -> tuple[float, float]:
    """``(device bytes, host bytes)`` the kept tensors and the copy buffers of ``layers`` need at peak."""
    device = host = 0.0
    largest_host = 0.0
    for layer in layers:
        stash = costs.stash_bytes(layer.keep_attention, layer.alpha)
        if layer.on_host:
            host += stash
            largest_host = max(largest_host, stash)
        else:
            device += stash
    return device + 2 * largest_host, host


def policy_seconds(layers: tuple[LayerPolicy, ...], costs: LayerCosts, bandwidth: float) -> float:
    """The cost model's step time of ``layers`` (decoder layers only)."""
    return sum(costs.layer_seconds(layer, bandwidth) for layer in layers)


def _check(name: str, value: float, minimum: float, strict: bool = False) -> None:
    bad = not math.isfinite(value) or (value <= minimum if strict else value < minimum)
    if bad:
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {minimum}, got {value!r}")


def _balanced(count: int, units: int, steps: int) -> list[float]:
    """``count`` alphas on the grid summing to ``units / steps``, differing by at most one step."""
    low, extra = divmod(units, count) if count else (0, 0)
    return [(low + 1) / steps] * extra + [low / steps] * (count - extra)


def _cap(room: float, unit: float, steps: int) -> int:
    """Alpha steps of one layer that fit ``room`` bytes (all of them when an alpha step costs nothing)."""
    return steps if unit == 0 else min(steps, math.floor(room / unit + 1e-9))


def _shortfall(num_layers: int, costs: LayerCosts, device_budget: float, host_budget: float, smallest: float) -> None:
    """Raise :class:`PolicyDoesNotFit` for the smallest stash: as many layers on the device as fit, the rest on host."""
    resident = min(2, num_layers)
    device_layers = resident
    for count in range(num_layers, resident - 1, -1):
        need = count * smallest + (2 * smallest if count < num_layers else 0.0)
        if need <= device_budget:
            device_layers = count
            break
    device_need = device_layers * smallest + (2 * smallest if device_layers < num_layers else 0.0)
    host_need = (num_layers - device_layers) * smallest
    device_short, host_short = max(0.0, device_need - device_budget), max(0.0, host_need - host_budget)
    raise PolicyDoesNotFit(
        f"no memory policy fits: even keeping the smallest stash ({smallest / 2**30:.3f} GiB per layer) needs "
        f"{device_short / 2**30:.3f} GiB ({device_short:.0f} bytes) more device memory and "
        f"{host_short / 2**30:.3f} GiB ({host_short:.0f} bytes) more host memory than the budgets "
        f"(device {device_budget / 2**30:.3f} GiB, host {host_budget / 2**30:.3f} GiB); shorten the sequence "
        "or raise the budgets",
        device_short,
        host_short,
    )


def solve_policy(
    num_layers: int,
    costs: LayerCosts,
    bandwidth: float,
    device_budget: float,
    host_budget: float,
    alpha_steps: int,
) -> MemoryPolicy:
    """The policy of every decoder layer that minimises the predicted step time (see the module docstring).

    Args:
        num_layers: decoder layers ``n`` (all of one shape).
        costs: one layer's bytes and seconds at the step shape.
        bandwidth: device<->host copy bytes per second (each direction).
        device_budget: device bytes for the kept tensors and the copy buffers (what is left after
            parameters, gradients, optimizer state and the step's workspace).
        host_budget: host bytes for the kept tensors.
        alpha_steps: alphas are multiples of ``1 / alpha_steps`` (the executor's chunk count, or a
            coarser grid: the executor rounds alpha down to whole chunks, which only lowers memory).

    Returns:
        the policy, with ``predicted_step_seconds`` (decoder layers only), ``device_bytes``, ``host_bytes``
        and ``bound``: ``"all"`` (nothing recomputed, no copy exposed), else which of ``"device memory"``,
        ``"host memory"`` (only with host bytes) is within one alpha step of full, else ``"bandwidth"``.

    Raises:
        PolicyDoesNotFit: not even ``X`` only with alpha 0 everywhere fits, with the shortfall in bytes.
    """
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    if not isinstance(alpha_steps, int) or alpha_steps < 1:
        raise ValueError(f"alpha_steps must be an int >= 1, got {alpha_steps!r}")
    _check("bandwidth", bandwidth, 0.0, strict=True)
    for name in ("device_budget", "host_budget"):
        _check(name, locals()[name], 0.0)
    for name, value in vars(costs).items():
        if not (name == "ahead_bytes" and value == math.inf):  # inf: the whole stash fetched ahead
            _check(f"costs.{name}", value, 0.0)

    n, steps = num_layers, alpha_steps
    kinds = (True, False)  # keep X + attention output, keep X only
    unit = costs.other_bytes / steps  # bytes of one alpha step of one layer
    step_saving = costs.other_seconds / steps  # a device layer's seconds saved by one alpha step

    def host_seconds(keep: bool, q: int) -> float:
        return costs.layer_seconds(LayerPolicy(keep, True, q / steps), bandwidth)

    # Per host kind, the seconds each further alpha step saves (nondecreasing: the time is convex in alpha).
    marginals = sorted(
        (host_seconds(keep, q + 1) - host_seconds(keep, q), q, keep) for keep in kinds for q in range(steps)
    )
    device_seconds = {keep: costs.layer_seconds(LayerPolicy(keep, False, 0.0), bandwidth) for keep in kinds}
    base = {keep: costs.stash_bytes(keep, 0.0) for keep in kinds}

    best: tuple[float, tuple] | None = None
    for host_attn in range(n + 1):
        for host_x in range(n + 1 - host_attn):
            on_device = n - host_attn - host_x
            if on_device < min(2, n):
                continue
            host_counts = {True: host_attn, False: host_x}
            host_fixed = sum(host_counts[k] * base[k] for k in kinds)
            if host_fixed > host_budget:
                continue
            free_units = math.inf if unit == 0 else math.floor((host_budget - host_fixed) / unit + 1e-9)
            present = [k for k in kinds if host_counts[k]]
            if present:  # candidate sizes of the largest host stash (the copy buffers)
                floor = max(base[k] for k in present)
                buffers = sorted({base[k] + q * unit for k in present for q in range(steps + 1)})
                buffers = [b for b in buffers if b >= floor]
            else:
                buffers = [0.0]
            for buffer in buffers:
                caps = {
                    k: steps if unit == 0 else min(steps, math.floor((buffer - base[k]) / unit + 1e-9)) for k in kinds
                }
                host_time, left, taken = 0.0, free_units, dict.fromkeys(kinds, 0)
                for saving, q, keep in marginals:
                    if saving >= 0 or left <= 0:
                        break
                    if q >= caps[keep] or not host_counts[keep]:
                        continue
                    take = min(host_counts[keep], left)
                    host_time += take * saving
                    taken[keep] += take
                    left -= take
                host_time += sum(host_counts[k] * host_seconds(k, 0) for k in kinds)
                device_free = device_budget - (2 * buffer if present else 0.0)
                for device_attn in range(on_device + 1):
                    room = device_free - device_attn * base[True] - (on_device - device_attn) * base[False]
                    if room < 0:
                        continue
                    units = steps * on_device if unit == 0 else min(steps * on_device, math.floor(room / unit + 1e-9))
                    seconds = (
                        host_time
                        + device_attn * device_seconds[True]
                        + (on_device - device_attn) * device_seconds[False]
                        - units * step_saving
                    )
                    if best is None or seconds < best[0] - 1e-12:
                        best = (seconds, (host_counts, taken, on_device, device_attn, units))
    if best is None:
        _shortfall(n, costs, device_budget, host_budget, costs.stash_bytes(False, 0.0))
    _, (host_counts, taken, on_device, device_attn, units) = best
    layers: list[LayerPolicy] = []
    for keep in kinds:
        layers += [LayerPolicy(keep, True, a) for a in _balanced(host_counts[keep], taken[keep], steps)]
    device_alphas = _balanced(on_device, units, steps)
    layers += [LayerPolicy(i < device_attn, False, a) for i, a in enumerate(device_alphas)]
    layers_t = tuple(layers)  # bottom first: host layers, then the device ones (the top two among them)
    device, host = policy_memory(layers_t, costs)
    seconds = policy_seconds(layers_t, costs, bandwidth)
    recompute = sum(costs.recompute_seconds(layer.keep_attention, layer.alpha) for layer in layers_t)
    exposed = seconds > (n * (costs.forward_seconds + costs.backward_seconds) + recompute) * (1 + 1e-12)
    if recompute == 0 and not exposed:
        bound = "all"
    elif device + unit > device_budget:
        bound = "device memory"
    elif host > 0 and host + unit > host_budget:
        bound = "host memory"
    else:
        bound = "bandwidth"
    return MemoryPolicy(layers_t, seconds, device, host, bound)
