"""``MemoRuntime``: the memo executor's per-model state — memory policy per shape, host pool, copy streams, buffers."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace

import psutil
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from hf_memo.config import MemoConfig
from hf_memo.planner.plan import MemoryPlan
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.planner.policy_solver import (
    LayerCosts,
    PolicyDoesNotFit,
    fetch_split,
    policy_memory,
    policy_seconds,
    solve_policy,
)
from hf_memo.runtime.alpha import quantise, solve_offload_fraction
from hf_memo.runtime.arena import Arena, ArenaWarning
from hf_memo.runtime.buckets import bucket_length, stretch
from hf_memo.runtime.calibration import (
    LayerBytes,
    LayerForward,
    host_bandwidth,
    layer_bytes_per_token,
    snapped,
    time_layer_forward,
)
from hf_memo.runtime.executor import AttentionCore, LayerSplit, runs_in_blocks
from hf_memo.runtime.offload import HostPool, copy_engine
from hf_memo.runtime.stash import CopiesInFlight, DeviceSlots, LayerStash

logger = logging.getLogger(__name__)


class _OptimizerSteps:
    """Optimizer steps taken in this process by any ``torch.optim`` optimizer (a global post-step hook,
    registered when the first runtime is made)."""

    count = 0
    _registered = False

    @classmethod
    def track(cls) -> None:
        if not cls._registered:
            register_optimizer_step_post_hook(cls._stepped)
            cls._registered = True

    @classmethod
    def _stepped(cls, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        cls.count += 1


AUTO_HOST_FRACTION = 0.5  # of the RAM available when the runtime is created
# A layer's backward holds a gradient beside each tensor its forward pattern holds (x and grad x, q/k/v and
# dq/dk/dv, the attention output and its gradient, a chunk's activations and theirs): twice the forward's.
BACKWARD_WORKSPACE_FACTOR = 2
# A layer's backward computes about twice its forward's FLOPs (a gradient for the input and one for the weights):
# the policy solver's T_b, which the runtime does not time.
BACKWARD_TO_FORWARD = 2
SIZING_SOLVES = 6  # solves per step shape, each short by what the previous policy's own profile needed over the limit
SOLVER_ALPHA_STEPS = 16  # the finest alpha grid the policy solver searches (the executor rounds down to chunks)


@dataclass(frozen=True)
class OffloadDecision:
    """What the executor does for one step shape: every layer's ``policy``, and whether the LM head's input
    goes to the host (see :meth:`MemoRuntime.open_head_stash`)."""

    policy: MemoryPolicy
    head_offloaded: bool

    def to_dict(self) -> dict:
        """JSON-serialisable form (recorded in the memory plan made for it)."""
        return {
            "layers": [asdict(layer) for layer in self.policy.layers],
            "bound": self.policy.bound,
            "head_offloaded": self.head_offloaded,
        }


@dataclass(frozen=True)
class StepMeasurements:
    """What the runtime measured on the first step of a shape: the inputs of the policy decision.

    Attributes:
        num_layers: decoder layers ``n``.
        tokens: ``B * S`` tokens of the step (one rank's shard under sequence parallelism).
        chunks: the executor's mini-sequence chunks per layer (alpha is applied in whole chunks).
        per_token: ``S_in``, ``S_attn``, ``S_other`` of one layer, bytes per token.
        layer_seconds: one layer's forward ``T`` (``MemoConfig.layer_time`` or timed; ``None``: not measured,
            ``offload_fraction`` was given, or the CPU without a device limit, see :meth:`MemoRuntime._measure`).
        attention_seconds: the attention core's part of it (``T_attn``, its timed share of ``T``; ``T - T_attn``
            is the rest, ``T_other``); ``None`` when not timed.
        bandwidth: device<->host bytes per second (``MemoConfig.host_bandwidth`` or measured; ``None`` when
            ``layer_seconds`` is).
        host_budget: host bytes the kept tensors may use (``MemoConfig.host_memory_limit``).
        device_budget: device bytes the kept tensors and copy buffers may use: the device limit minus what is
            allocated now (weights, gradients, optimizer state) minus the backward's workspace (``None``: no
            limit, CPU with ``device_memory_limit="auto"``).
        requested_alpha: ``MemoConfig.offload_fraction`` when not ``"auto"``.
        batch_size: sequences of the step (``tokens / batch_size`` is its bucket's length).
        device_limit: device bytes the step may use (``None``: no limit).
        device_in_use: device bytes allocated now plus the gradients the backward will allocate.
        blocked: the layer's backward runs in blocks of queries and memory is not planned, so the layer below is
            fetched ahead only as far as the keys' gradient sums give memory back (see ``LayerCosts``).
    """

    num_layers: int
    tokens: int
    chunks: int
    per_token: LayerBytes
    layer_seconds: float | None
    attention_seconds: float | None
    bandwidth: float | None
    host_budget: float
    device_budget: float | None
    requested_alpha: float | None
    batch_size: int = 1
    device_limit: int | None = None
    device_in_use: int = 0
    blocked: bool = False


PREFETCH_SLOTS = "prefetch"
"""Name of the buffers swapped stashes are fetched into (:class:`~hf_memo.runtime.stash.DeviceSlots`)."""


class _Transport:
    """Per-device copy engine, host pool (holding at most ``host_limit`` bytes), prefetch buffers (from ``arena`` once
    a plan is made; ``planned``: the steps' memory is planned, see :class:`DeviceSlots`) and the stash whose copies
    to the host may still run (:class:`CopiesInFlight`)."""

    def __init__(
        self, device: torch.device, arena: Arena | None, host_limit: int | None = None, planned: bool = False
    ) -> None:
        self.engine = copy_engine(device)
        self.pool = HostPool(device, limit=host_limit, copies=self.engine)
        self.prefetch = DeviceSlots(PREFETCH_SLOTS, device, self.engine, arena, planned)
        self.in_flight = CopiesInFlight()


class MemoRuntime:
    """State shared by the decoder layers of one model under ``recompute="memo"``.

    Attributes:
        attention_calls: attention forwards run by the executor (in forward, and in backward for layers
            that keep their input only).
        plan: the :class:`~hf_memo.planner.policy.MemoryPolicy` of the most recent layer shape.
        memory_plan: the memory plan whose arena serves the prefetch buffers (``planner`` on).
        planned_memory: whether the steps' memory is planned (``planner`` on, or a fake copy of such a model).

    Args:
        planner: ``planner(batch_size, seq_len, offload=decision)`` makes a memory plan for a step of that
            shape run with that :class:`OffloadDecision`; called on the first step of a shape, after the
            offload is solved, unless the attached plan was made for that shape and offload
            (``config.planner`` on).
        parameters: the model's parameters (e.g. ``model.parameters``): the gradients they do not hold yet,
            which the backward will allocate, are kept out of the device budget.
        sizer: ``sizer(batch_size, seq_len, policy)`` -> the device bytes a step of that shape holds at its peak
            under ``policy`` beyond the model states (from profiles of that policy, see
            :mod:`~hf_memo.runtime.policy_sizer`): with a device limit, the solver's policy is checked against it
            and solved again with the budget short by what was over, until its own profile fits (``None``, or the
            attribute ``sizer`` set to ``None``: the solver's policy as it is).

    With a device limit, a shape decided before any optimizer step is decided again at its first step after
    one: the optimizer's state (e.g. AdamW's two moments) only takes device memory from its first step on.
    """

    def __init__(
        self,
        config: MemoConfig,
        num_layers: int,
        planner: Callable[..., MemoryPlan] | None = None,
        parameters: Callable[[], Iterable[torch.nn.Parameter]] | None = None,
        sizer: Callable[[int, int, MemoryPolicy], int] | None = None,
    ) -> None:
        self.config = config
        self.sizer = sizer
        self.num_layers = num_layers
        self.memory_plan: MemoryPlan | None = None
        # The steps' prefetch buffers are laid out by a memory plan, or a fake copy profiles such steps: stashes
        # fetch whole, as the plan's arena is laid out (see DeviceSlots); read when a device's buffers are made.
        self.planned_memory = config.planner != "off"
        self._planner = planner
        self._parameters = parameters
        _OptimizerSteps.track()
        self._steps_at_start = _OptimizerSteps.count
        self._before_optimizer: set[tuple] = set()  # shapes decided before any optimizer step, with a device limit
        limit = config.host_memory_limit_bytes
        self.host_limit = limit if limit is not None else int(AUTO_HOST_FRACTION * psutil.virtual_memory().available)
        self.attention_calls = 0
        self.plan: MemoryPolicy | None = None
        self._probing = False
        self._decisions: dict[tuple, OffloadDecision] = {}
        self._fixed: OffloadDecision | None = None
        self._policy: MemoryPolicy | None = None
        self._bandwidth: dict[torch.device, float] = {}
        self._transports: dict[torch.device, _Transport] = {}
        # The stashes of the forward running now, by layer index (weak: the graph holds a layer's stash until its
        # backward; an aborted step must not outlive its graph), and the index of the layer that opened one last.
        self._forward: dict[int, weakref.ref[LayerStash]] = {}
        self._last_opened = -1
        self._stretch = 1.0  # of the step shape whose layers run now (see alpha_chunks)

    def __deepcopy__(self, memo: dict) -> MemoRuntime:
        """A runtime for a copy of the model: same config, planner (bound to the copy) and assumed policy; what
        was measured, decided and allocated for the original is not carried over (the copy decides its own)."""
        planner, parameters = copy.deepcopy(self._planner, memo), copy.deepcopy(self._parameters, memo)
        copied = MemoRuntime(self.config, self.num_layers, planner, parameters, copy.deepcopy(self.sizer, memo))
        copied.host_limit, copied._policy, copied._fixed = self.host_limit, self._policy, self._fixed
        return copied

    # -- memory policy --------------------------------------------------------------------------------
    def alpha_chunks(
        self, split: LayerSplit, x: torch.Tensor, bounds: list[tuple[int, int]], core: AttentionCore, index: int
    ) -> int:
        """Chunks (of ``bounds``, the executor's chunks) whose tokens layer ``index`` offloads for a layer input
        ``x`` ``(B, S, H)`` whose attention runs through ``core``.

        The first step of a new shape decides the memory policy (measuring on ``x``) and then, with a
        planner, plans memory for it. Shapes are bucketed by length (:mod:`~hf_memo.runtime.buckets`): the
        decision and plan are made for the bucket's longest length, and serve every length of the bucket.
        """
        key = _shape_key(x)
        self._stretch = stretch(x.shape[1])
        if key in self._before_optimizer and _OptimizerSteps.count > self._steps_at_start:
            self._before_optimizer.discard(key)  # decided again: the optimizer's state now takes device memory
            del self._decisions[key]
        if key not in self._decisions:
            decision = self._decisions[key] = self._fixed or self._solve(split, x, bounds, core)
            solved = self._fixed is None and self._policy is None and self._device_limit(x.device) is not None
            if solved and _OptimizerSteps.count == self._steps_at_start:
                self._before_optimizer.add(key)
            policy = decision.policy
            predicted = "" if policy.predicted_step_seconds is None else f", {policy.predicted_step_seconds:.3g} s"
            logger.info(
                "hf_memo: memory policy for layer inputs %s: %s (bound: %s%s; LM head input on the host: %s)",
                tuple(x.shape),
                policy.summary(),
                policy.bound,
                predicted,
                decision.head_offloaded,
            )
            if self.config.planner != "off" and not self._probing:
                self._plan_memory(x.shape[0], bucket_length(x.shape[1]), decision)
        self.plan = self._decisions[key].policy
        return quantise(self.plan.layers[index].alpha, len(bounds))

    @contextlib.contextmanager
    def probe(self) -> Iterator[None]:
        """Steps inside leave no trace: a self-check's probe decides and measures for its own shape, plans no memory,
        and afterwards the runtime's decisions, policy, plan and attention count are what they were."""
        state = (dict(self._decisions), set(self._before_optimizer), self.plan, self.memory_plan, self.attention_calls)
        self._probing = True
        try:
            yield
        finally:
            self._probing = False
            decisions, before, self.plan, memory_plan, self.attention_calls = state
            self._decisions, self._before_optimizer = decisions, before
            if self.memory_plan is not memory_plan:
                self.attach_memory_plan(memory_plan)

    def offload_for(self, batch_size: int, seq_len: int) -> OffloadDecision | None:
        """The decision made for layer inputs of ``batch_size`` sequences of ``seq_len`` tokens (its length bucket),
        if any yet."""
        wanted = (batch_size, bucket_length(seq_len))
        return next((d for key, d in self._decisions.items() if key[0][:2] == wanted), None)

    def assume_offload(self, decision: OffloadDecision) -> None:
        """Use ``decision`` for every shape instead of solving (a profiling copy runs the real model's offload)."""
        self._fixed = decision

    def assume_policy(self, policy: MemoryPolicy) -> None:
        """Run ``policy`` (one :class:`~hf_memo.planner.policy.LayerPolicy` per decoder layer) for every step
        shape from the next step on, instead of deciding one per shape. Whether the LM head's input goes to
        the host is still decided per shape, from the host bytes the policy leaves."""
        if len(policy.layers) != self.num_layers:
            raise ValueError(
                f"the memory policy has {len(policy.layers)} layer policies; the model has {self.num_layers} "
                "decoder layers (one LayerPolicy per layer, bottom first)"
            )
        for index, layer in enumerate(policy.layers):
            if not 0.0 <= layer.alpha <= 1.0:
                raise ValueError(f"layer {index}'s policy has alpha={layer.alpha}; alpha must be in [0, 1]")
        self._policy = policy
        self._decisions.clear()

    @property
    def assumed_policy(self) -> MemoryPolicy | None:
        """The policy given to :meth:`assume_policy`, if any."""
        return self._policy

    def _solve(
        self, split: LayerSplit, x: torch.Tensor, bounds: list[tuple[int, int]], core: AttentionCore
    ) -> OffloadDecision:
        """The decision for ``x``'s shape: the assumed policy or :meth:`_decide`'s, and the LM head's offload."""
        if self._policy is not None:
            per_token, policy = layer_bytes_per_token(split, x), self._policy
        else:
            measured = self._measure(split, x, bounds, core)
            per_token, policy = measured.per_token, self._decide(measured)
        tokens = x.shape[0] * bucket_length(x.shape[1])  # the bucket's longest steps must fit
        host_bytes = sum(_kept_per_token(layer, per_token) for layer in policy.layers if layer.on_host) * tokens
        # Only beside host layers: when every layer stays on the device the step fits there, and the head's
        # copies would borrow copy buffers no layer made.
        swapping = any(layer.on_host for layer in policy.layers)
        head_bytes = tokens * x.shape[-1] * x.element_size()
        return OffloadDecision(policy, swapping and host_bytes + head_bytes <= self.host_limit)

    def _decide(self, measured: StepMeasurements) -> MemoryPolicy:
        """Every layer's policy for one step shape, from what was measured on it.

        With a device budget and alpha left to the runtime, the policy solver
        (:func:`~hf_memo.planner.policy_solver.solve_policy`): per layer, host or device, ``X`` + attention or
        ``X`` only, and alpha, for the least predicted step time within the device and host budgets.
        Otherwise (no device limit — CPU with ``device_memory_limit="auto"`` — or a fixed
        ``offload_fraction``) MEMO's LP (:func:`~hf_memo.runtime.alpha.solve_offload_fraction`): every layer
        keeps its input and attention output; the lowest ``n - 2`` go to the host, the top two stay on the
        device, all with one alpha.

        Raises:
            PolicyDoesNotFit: not even keeping ``X`` only, alpha 0, in every layer fits the budgets.
        """
        if measured.requested_alpha is None and measured.device_budget is not None:
            return self._solve_policy(measured)
        per_token, tokens = measured.per_token, measured.tokens
        plan = solve_offload_fraction(
            measured.num_layers,
            per_token.fixed * tokens,
            per_token.other * tokens,
            measured.host_budget,
            bandwidth=measured.bandwidth,
            layer_time=measured.layer_seconds,
            requested=measured.requested_alpha,
            device_budget=measured.device_budget,
            chunks=measured.chunks,
        )
        layers = tuple(LayerPolicy(True, index < plan.swapped_layers, plan.alpha) for index in range(self.num_layers))
        host_bytes = plan.swapped_layers * (per_token.fixed + plan.alpha * per_token.other) * tokens
        return MemoryPolicy(layers, host_bytes=host_bytes, bound=plan.bound)

    def _solve_policy(self, measured: StepMeasurements) -> MemoryPolicy:
        """The policy solver's answer for ``measured``; the layer's backward is taken as
        ``BACKWARD_TO_FORWARD`` times its forward (not timed)."""
        per_token, tokens, forward = measured.per_token, measured.tokens, measured.layer_seconds
        attention = min(measured.attention_seconds, forward)
        costs = LayerCosts(
            input_bytes=per_token.input * tokens,
            attention_bytes=per_token.attention * tokens,
            other_bytes=per_token.other * tokens,
            forward_seconds=forward,
            backward_seconds=BACKWARD_TO_FORWARD * forward,
            attention_seconds=attention,
            other_seconds=forward - attention,
            **fetch_split(measured.blocked, per_token.key_sums * tokens, per_token.output * tokens),
        )
        try:
            return self._sized(measured, costs)
        except PolicyDoesNotFit as error:
            # The smallest stash is per token: the budgets hold about this share of the step's tokens.
            shares = [
                budget / (budget + short)
                for budget, short in (
                    (measured.device_budget, error.device_shortfall),
                    (measured.host_budget, error.host_shortfall),
                )
                if short > 0
            ]
            fitting = int(tokens * max(0.0, min(shares, default=1.0)))
            raise PolicyDoesNotFit(
                f"recompute='memo' at {tokens} tokens per step: {error}; about {fitting} tokens per step would fit "
                "these budgets (MemoConfig.device_memory_limit, MemoConfig.host_memory_limit)",
                error.device_shortfall,
                error.host_shortfall,
            ) from None

    def _sized(self, measured: StepMeasurements, costs: LayerCosts) -> MemoryPolicy:
        """The solver's policy for ``measured``, solved again (at most ``SIZING_SOLVES`` times) with the device
        budget short by what the sizer finds over the limit, until the policy's own profile fits."""
        room = max(measured.device_budget, 0.0)
        steps = min(measured.chunks, SOLVER_ALPHA_STEPS)
        for _ in range(SIZING_SOLVES):
            policy = solve_policy(measured.num_layers, costs, measured.bandwidth, room, measured.host_budget, steps)
            policy = _on_chunks(policy, measured.chunks, costs, measured.bandwidth)
            if self.sizer is None or measured.device_limit is None:
                return policy
            seq_len = measured.tokens // measured.batch_size
            need = measured.device_in_use + self.sizer(measured.batch_size, seq_len, policy)
            if need <= measured.device_limit:
                return policy
            logger.info(
                "hf_memo: policy %s needs %d device bytes over the limit; solving again",
                policy.summary(),
                need - measured.device_limit,
            )
            room -= need - measured.device_limit + 1
            if room < 0:
                break
        short = need - measured.device_limit
        raise PolicyDoesNotFit(
            f"the policies the solver finds need more device memory than the limit once profiled ({policy.summary()}: "
            f"{short / 2**30:.3f} GiB over)",
            short,
            0.0,
        )

    def _measure(
        self, split: LayerSplit, x: torch.Tensor, bounds: list[tuple[int, int]], core: AttentionCore
    ) -> StepMeasurements:
        """Measure one layer on ``x`` ``(B, S, H)``: its bytes per token always; its forward time (and the
        attention core's part) and the host bandwidth when alpha is to be solved; the device budget. Tokens, and
        times and workspace measured on ``x``, are scaled up to the longest length of ``x``'s bucket.

        Plans are reproducible run to run: each timing is the fastest of a few runs, and measured times and
        bandwidth are snapped to eighth octaves (9% steps, :func:`~hf_memo.runtime.calibration.snapped`) before they
        decide anything. Noise of a few percent then changes a policy only where a measurement lies that close to a
        grid edge: a choice between neighbours whose costs differ by less than the cost model's own error (the
        backward is taken as twice the forward, untimed). ``MemoConfig.layer_time`` and ``host_bandwidth`` pin them.
        On the CPU without a device limit nothing is timed: a copy there is plain (no side stream hides it behind
        compute), so MEMO's copy bound does not apply and alpha follows from the bytes and the host limit, unless the
        config gives a layer time or a bandwidth (of another machine, to model it)."""
        fraction = self.config.offload_fraction
        requested = None if fraction == "auto" else float(fraction)
        device_limit = self._device_limit(x.device)
        timing: LayerForward | None = None
        solver = requested is None and device_limit is not None  # it needs the attention core's share of T
        # Copies hide behind compute only on CUDA's side streams: on the CPU a copy is plain, and without a device
        # limit nothing is timed there (alpha follows from bytes), unless the config gives T or B of a machine.
        given = self.config.layer_time is not None or self.config.host_bandwidth is not None
        copies = requested is None and (x.is_cuda or solver or given)
        if (copies and self.config.layer_time is None) or solver or (device_limit is not None and x.is_cuda):
            timing = time_layer_forward(split, x, bounds, core)
            longer = stretch(x.shape[1])
            timing = LayerForward(
                snapped(timing.seconds * longer),
                math.ceil(timing.workspace_bytes * longer),
                snapped(timing.attention_seconds * longer),
            )
        bandwidth = layer_time = attention_time = None
        if copies:
            if x.device not in self._bandwidth:
                pool = self._transport(x.device).pool
                self._bandwidth[x.device] = self.config.host_bandwidth or snapped(host_bandwidth(x, pool))
            bandwidth, layer_time = self._bandwidth[x.device], self.config.layer_time or timing.seconds
        if timing is not None:  # the timed share of attention, of the layer time used (configured or timed)
            attention_time = timing.attention_seconds * (layer_time or timing.seconds) / max(timing.seconds, 1e-12)
        device_budget, in_use = None, 0
        if device_limit is not None:
            workspace = 0 if timing is None else timing.workspace_bytes
            in_use = _device_in_use(x.device) + self._gradients_to_come(x.device)
            device_budget = device_limit - in_use - BACKWARD_WORKSPACE_FACTOR * workspace
        measured = StepMeasurements(
            num_layers=self.num_layers,
            tokens=x.shape[0] * bucket_length(x.shape[1]),
            chunks=len(bounds),
            per_token=layer_bytes_per_token(split, x),
            layer_seconds=layer_time,
            attention_seconds=attention_time,
            bandwidth=bandwidth,
            host_budget=self.host_limit,
            device_budget=device_budget,
            requested_alpha=requested,
            batch_size=x.shape[0],
            device_limit=device_limit,
            device_in_use=in_use,
            blocked=runs_in_blocks(core, x.shape[1], split.traits) and not self.planned_memory,
        )
        group = getattr(core, "group", None)  # a sequence-parallel core's process group
        if group is not None and requested is None and device_budget is not None:
            measured = _agreed(measured, group, x.device)
        return measured

    def _gradients_to_come(self, device: torch.device) -> int:
        """Bytes of the gradients the backward will allocate on ``device``: trainable parameters there without
        one now (this rank's shard of a sharded parameter)."""
        if self._parameters is None:
            return 0
        total = 0
        for param in self._parameters():
            # this rank's partition: ZeRO-3's (the parameter itself is a [0] placeholder), a DTensor's shard (FSDP2)
            local = getattr(param, "ds_tensor", None)
            local = getattr(param, "_local_tensor", param) if local is None else local
            if param.requires_grad and param.grad is None and local.device == device:
                total += local.numel() * local.element_size()
        return total

    def _device_limit(self, device: torch.device) -> int | None:
        """Device bytes a step may use: the configured limit, or on CUDA for ``"auto"`` what is free plus what
        PyTorch's allocator holds (``None``: no limit, CPU)."""
        limit = self.config.device_memory_limit_bytes
        if limit is not None or device.type != "cuda":
            return limit
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device)

    # -- memory plan --------------------------------------------------------------------------------------
    def attach_memory_plan(self, plan: MemoryPlan | None) -> None:
        """Serve the prefetch buffers from an arena laid out by ``plan`` (``None``: the allocator)."""
        self.memory_plan = plan
        for device, transport in self._transports.items():
            transport.prefetch.arena = None if plan is None else Arena(plan, device)

    def _plan_memory(self, batch_size: int, seq_len: int, decision: OffloadDecision) -> None:
        if _made_for(self.memory_plan, batch_size, seq_len, decision):
            return
        if self._planner is None:
            warnings.warn(
                f"no memory plan for batch {batch_size} x {seq_len} tokens; buffers come from the caching allocator",
                ArenaWarning,
                stacklevel=3,
            )
            self.attach_memory_plan(None)
        else:
            self.attach_memory_plan(self._planner(batch_size, seq_len, offload=decision))

    # -- stashes (the executor's StashSource) ---------------------------------------------------------
    def _transport(self, device: torch.device) -> _Transport:
        if device not in self._transports:
            arena = None if self.memory_plan is None else Arena(self.memory_plan, device)
            self._transports[device] = _Transport(device, arena, self.host_limit, self.planned_memory)
        return self._transports[device]

    def open_stash(self, index: int, device: torch.device) -> LayerStash:
        """A stash for layer ``index``; a layer at or below the last one that opened a stash starts a new forward."""
        if index <= self._last_opened:
            self._forward = {}
        self._last_opened = index
        transport = self._transport(device)
        layer = LayerPolicy(on_host=False) if self.plan is None else self.plan.layers[index]
        return LayerStash(
            index,
            layer.on_host,
            transport.engine,
            transport.pool,
            transport.prefetch,
            keep_attention=layer.keep_attention,
            stretch=self._stretch,
            in_flight=transport.in_flight,
        )

    def open_head_stash(self, hidden: torch.Tensor) -> LayerStash | None:
        """A swapped stash for the LM head's input ``hidden`` ``(B, S, H)``, or ``None`` to keep it on the device.

        ``None`` when no layer of that shape has run yet, when no layer is on the host, or when the host
        limit has no room for it beside the layers' offloaded bytes. It is fetched into the prefetch buffer of an
        imaginary layer ``n``: that of layer ``n - 2``, free again by then.
        """
        decision = self._decisions.get(_shape_key(hidden))
        if decision is None or not decision.head_offloaded:
            return None
        transport = self._transport(hidden.device)
        return LayerStash(
            self.num_layers,
            True,
            transport.engine,
            transport.pool,
            transport.prefetch,
            stretch=stretch(hidden.shape[1]),
            in_flight=transport.in_flight,
        )

    def sealed(self, index: int, stash: LayerStash) -> None:
        """Layer ``index``'s forward ended: link its stash to the one below it in the same forward."""
        stash.below = self._forward.get(index - 1)
        self._forward[index] = weakref.ref(stash)

    def fetch_below(self, stash: LayerStash, nbytes: int | None) -> None:
        below = stash.lower
        if below is not None:
            below.prefetch(nbytes)

    def backward_done(self, stash: LayerStash, device: torch.device) -> None:
        """After the lowest layer the executor ran in ``stash``'s forward (layer 0, or the next one up when layers
        below ran outside it, e.g. under a checkpoint function of their own) that graph's backward is over: the
        prefetch buffers are free. Once no graph holds a host buffer any more (other graphs alive, or this one
        retained, hold theirs) the step is over: the host buffers no request of it used are freed."""
        if stash.lower is None:
            transport = self._transport(device)
            transport.prefetch.release_all()
            if transport.pool.in_use_bytes == 0:
                transport.pool.end_step()

    def attention_ran(self) -> None:
        self.attention_calls += 1

    # -- statistics -----------------------------------------------------------------------------------
    @property
    def host_reserved_bytes(self) -> int:
        """Host bytes held by the offload pools (reused across steps): the bytes really pinned, on CUDA."""
        return sum(t.pool.reserved_bytes for t in self._transports.values())

    @property
    def device_buffer_bytes(self) -> int:
        """Device bytes of the prefetch buffers held now."""
        return sum(t.prefetch.reserved_bytes for t in self._transports.values())


def _agreed(measured: StepMeasurements, group: dist.ProcessGroup, device: torch.device) -> StepMeasurements:
    """``measured`` made the same on every rank of a sequence-parallel ``group``: the slowest layer and attention
    times, the lowest bandwidth, budgets and device limit, the most device memory in use. Every rank then solves and
    sizes the same policy, as it must: a layer keeping ``X`` only runs attention's all-to-alls again in backward, on
    all ranks or none (a rank sizing with its own limit or memory in use, which NCCL's buffers or ZeRO's remainders
    make differ, could keep other layers and wait on an all-to-all the others never make)."""
    limit = math.inf if measured.device_limit is None else float(measured.device_limit)
    values = torch.tensor(
        [-measured.layer_seconds, -measured.attention_seconds, measured.bandwidth]
        + [measured.device_budget, measured.host_budget, limit, -float(measured.device_in_use)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    layer, attention, bandwidth, device_budget, host_budget, limit, in_use = values.tolist()
    return replace(
        measured,
        layer_seconds=-layer,
        attention_seconds=-attention,
        bandwidth=bandwidth,
        device_budget=device_budget,
        host_budget=host_budget,
        device_limit=None if math.isinf(limit) else int(limit),
        device_in_use=int(-in_use),
    )


def _on_chunks(policy: MemoryPolicy, chunks: int, costs: LayerCosts, bandwidth: float) -> MemoryPolicy:
    """``policy`` with every alpha rounded down to whole chunks of ``chunks`` (what the executor runs), its predicted
    time and memory recomputed; the policy itself when its alphas are on that grid already."""
    layers = tuple(replace(layer, alpha=quantise(layer.alpha, chunks) / chunks) for layer in policy.layers)
    if layers == policy.layers:
        return policy
    device, host = policy_memory(layers, costs)
    return replace(
        policy,
        layers=layers,
        predicted_step_seconds=policy_seconds(layers, costs, bandwidth),
        device_bytes=device,
        host_bytes=host,
    )


def _shape_key(x: torch.Tensor) -> tuple:
    """A decision's key: ``x``'s shape with its length ``S`` (dimension 1) bucketed, dtype, device."""
    return (x.shape[0], bucket_length(x.shape[1]), *x.shape[2:]), x.dtype, x.device


def _kept_per_token(layer: LayerPolicy, per_token: LayerBytes) -> float:
    """Bytes per token a layer under ``layer`` keeps: ``S_in``, ``S_attn`` if it keeps attention, ``alpha S_other``."""
    return (per_token.fixed if layer.keep_attention else per_token.input) + layer.alpha * per_token.other


def _device_in_use(device: torch.device) -> int:
    """Device bytes allocated now (weights, gradients, optimizer state, the batch); 0 on CPU."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _made_for(plan: MemoryPlan | None, batch_size: int, seq_len: int, decision: OffloadDecision) -> bool:
    """Whether ``plan`` was made for steps of ``batch_size`` sequences of ``seq_len`` tokens run with ``decision``."""
    return (
        plan is not None
        and (plan.meta.get("batch_size"), plan.meta.get("seq_len")) == (batch_size, seq_len)
        and plan.meta.get("offload") == decision.to_dict()
    )
