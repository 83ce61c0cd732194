"""The memo mode in ``hf-memo estimate``: the memory policy the runtime's solver picks, sized by its own profiles.

The solver (:func:`~hf_memo.planner.policy_solver.solve_policy`) needs a layer's stash bytes: ``S_in + S_attn``
from the shapes (the layer input, the attention output and its statistics), ``S_other`` from the host bytes of
the smallest MEMO policy (every layer but the top two keeps ``X`` and the attention output on the host) profiled
at ``alpha = 0`` and at ``alpha = 1``. Its answer is only a candidate: the memory of the policy it
picks is never arithmetic on another policy's peak: it is read off profiles of that policy
(:mod:`~hf_memo.estimator.policy_footprint`), the runtime told to run exactly it, working sets included.

Like the runtime, which decides once per length bucket (:mod:`hf_memo.runtime.buckets`), the policy and memory of
a step are those of the longest step of its bucket (at most 1/32 longer): the host buffers are that size.

Times are FLOP counts at the GPU's bf16 dense peak (an upper bound on speed, so a lower bound on how
much copy time compute can hide): a layer's forward is ``2 * weights * tokens`` plus the causal
attention core ``2 * B * S² * a``; backward twice that (input gradients only for frozen weights).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from hf_memo.estimator.fitted import BASE_CHUNKS, ConfigFacts, ProfilePlan, chunk_rows, trace_at
from hf_memo.estimator.policy_footprint import (
    BOTTOM_FIT_COUNT,
    FIT_COUNT,
    PolicyFootprint,
    PolicyShape,
    fit_jobs,
    fit_points,
)
from hf_memo.estimator.question import Budget
from hf_memo.estimator.setups import Chunks
from hf_memo.estimator.time_model import Gpu, ModelFacts, attention_imbalance
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.planner.policy_solver import (
    LayerCosts,
    PolicyDoesNotFit,
    fetch_split,
    policy_memory,
    policy_seconds,
    solve_policy,
)
from hf_memo.profiler.analysis import Peak, peak
from hf_memo.profiler.closed_form import Restate
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.runtime.buckets import bucket_length

if TYPE_CHECKING:
    from transformers import PretrainedConfig


# The finest alpha grid the estimator solves on: coarser than the runtime's 1/16, so that the profiles of a chosen
# policy cut at most 8 MLP chunks (16 in the fit's second profile) and take seconds; the policy is a little slower
# than the runtime's, its memory exact.
MAX_ALPHA_STEPS = 8


def alpha_steps(config: PretrainedConfig, batch_size: int, seq_len: int) -> int:
    """The solver's alpha grid at ``seq_len`` (one rank's positions): the most steps, at most ``MAX_ALPHA_STEPS``,
    that divide the MLP chunks the runtime cuts there, so that every alpha is whole chunks and the runtime, which
    rounds an alpha down to whole chunks, runs the policy as sized (7 chunks: sevenths, 12: sixths, 64: eighths)."""
    rows = chunk_rows(config, "memo", batch_size, seq_len)[0] // batch_size
    chunks = -(-seq_len // rows)
    return max(d for d in range(1, MAX_ALPHA_STEPS + 1) if chunks % d == 0)


def backward_in_blocks(text_config: Any, seq_len: int, sequence_parallel: int) -> bool:
    """Whether memo's executor runs a layer's backward over ``seq_len`` positions in blocks of queries: the
    runtime's rule (:func:`hf_memo.runtime.blocked_attention.blockable`: no attention dropout in training, no
    sliding window that hides a key) read off the text config, on a sequence not split over ranks."""
    window = getattr(text_config, "sliding_window", None)
    dropout = getattr(text_config, "attention_dropout", 0.0) or 0.0
    return sequence_parallel == 1 and dropout == 0 and not (window and window < seq_len)


@dataclass(frozen=True)
class MemoProfile:
    """What the solver needs of the memo mode at one length (one rank's).

    ``base_bytes`` is the device peak of the smallest policy (every layer keeps ``X`` only, the top two on the
    device, the rest on the host), as profiled, less the kept tensors and copy buffers the solver counts for it:
    the room any policy's kept tensors may take is the GPU memory minus that. Other policies' working sets differ
    a little; :meth:`MemoModel.choose` checks every answer against its own profile.
    """

    seq_len: int
    base_bytes: float
    costs: LayerCosts
    state_host: int = 0  # host bytes of the rank's offloaded model states (optimizer offload)


@dataclass(frozen=True)
class MemoChoice:
    """The memo mode at one length and budget: the policy (``None`` if nothing fits) and the memory its own
    profile shows (the smallest policy's when nothing fits)."""

    policy: MemoryPolicy | None
    device: Peak
    host: Peak
    shortfall: str = ""


X_ON_HOST, X_ON_DEVICE = LayerPolicy(False, True, 0.0), LayerPolicy(False, False, 0.0)
SMALLEST_KINDS = (X_ON_HOST, X_ON_DEVICE)  # the smallest policies: X only, alpha 0, on the host then the device
NO_FIT_ONCE_PROFILED = "no policy the solver finds fits once profiled (the budgets are too small for its working set)"
REFINES = 6  # solves per answer: each one's budget less what the previous policy's profile showed over


def smallest_policy(layers: int, on_device: int) -> PolicyShape:
    """``X`` only, alpha 0, in every layer: the top ``on_device`` on the device, the others on the host."""
    return PolicyShape(SMALLEST_KINDS, (layers - on_device, on_device))


Runner = Callable[[Sequence[Callable[[], AllocationTrace]]], list[AllocationTrace]]


def _run_here(jobs: Sequence[Callable[[], AllocationTrace]]) -> list[AllocationTrace]:
    return [job() for job in jobs]


class MemoModel:
    """Profiles the memo executor and solves its memory policy at any length and budget.

    Two kinds of profiles serve two purposes. The solver's per-layer bytes: ``S_in + S_attn`` from the shapes,
    ``S_other`` from profiles of the smallest MEMO policy at ``alpha = 0`` and ``alpha = 1``. The memory of a policy
    is that policy's own profile: :class:`~hf_memo.estimator.policy_footprint.PolicyFootprint` fits every policy
    made of the same blocks of layers at once; the smallest policies' are profiled with the rest, others' when a
    policy of theirs is first chosen (``run_jobs`` runs them). An answer is the solver's policy whose own profile
    fits the budgets: when it does not, the solver runs again with the budget short by what was over.

    Args:
        profiler_for: ``profiler_for(offload_fraction, chunks)`` -> a fresh-model :class:`StepProfiler` of the memo
            mode with that fixed offload fraction, those chunk settings and no host limit.
        batch_size: sequences per step.
        gpu: peak FLOP/s and host bandwidth of the cost model.
        max_seq_len: the longest length the model's positions allow.
        sequence_parallel: ranks ``K`` a sequence is split over: profiles are of one rank's ``S / K`` tokens, FLOPs
            of one rank's share.
        adjust: ``adjust(device_peak, seq_len)`` -> ``(rank's device peak, host bytes of its model states)`` (see
            :func:`~hf_memo.estimator.cluster.rank_peak`); by default the single-GPU peak, nothing on the host.
        traces: the results of :meth:`jobs` in their order, if they were run already (e.g. side by side with other
            modes' profiles); by default they are run here, one after the other.
        policy_profiler_for: ``policy_profiler_for(policy, chunks)`` -> a fresh-model :class:`StepProfiler` of the
            memo mode running ``policy``.
        run_jobs: runs profile jobs and returns their traces in order (by default here, one after the other).
        restate: maps profile moments' bytes by category to those that count before the highest is chosen (the
            model states as a rank holds them; see :meth:`~hf_memo.profiler.closed_form.ClosedForm.peak`), for
            ``adjust`` to take; by default the profile's own.
    """

    def __init__(
        self,
        profiler_for: Callable[[float, Chunks], StepProfiler],
        batch_size: int,
        gpu: Gpu,
        max_seq_len: int = 1 << 24,
        sequence_parallel: int = 1,
        adjust: Callable[[Peak, int], tuple[Peak, int]] | None = None,
        traces: Sequence[AllocationTrace] | None = None,
        policy_profiler_for: Callable[[MemoryPolicy, Chunks], StepProfiler] | None = None,
        run_jobs: Runner = _run_here,
        restate: Restate | None = None,
    ) -> None:
        if policy_profiler_for is None:
            raise ValueError("MemoModel needs policy_profiler_for: policies are sized from their own profiles")
        if traces is None:
            traces = run_jobs(self.jobs(profiler_for, policy_profiler_for, max_seq_len))
        base = profiler_for(0.0, BASE_CHUNKS)
        plan = ProfilePlan.of(base, "memo", max_seq_len)
        if len(traces) != 2 + len(fit_points(SMALLEST_KINDS, max_seq_len)):
            raise ValueError(f"MemoModel.jobs gives 2 + the smallest policies' profiles, got {len(traces)} traces")
        alpha_zero, alpha_one, *smallest_traces = traces
        self.config, self.layers = ConfigFacts.of(base.config), base.layers
        if self.layers < 3:
            raise ValueError(f"the memo mode's estimate needs a model of at least 3 layers, got {self.layers}")
        self.batch_size = self._batch_size = batch_size
        self.sequence_parallel = sequence_parallel
        self.gpu = gpu
        self._adjust, self._restate = adjust, restate
        self._max_seq_len = max_seq_len
        self._policy_profiler_for, self.run_jobs = policy_profiler_for, run_jobs
        depth, seq_len = plan.depths[0], plan.seq_lens[-1]
        swapped = (depth - 2) * batch_size * seq_len  # tokens of the layers the two profiles offload
        self._other_per_token = (peak(alpha_one, "host").total - peak(alpha_zero, "host").total) / swapped
        self._footprints = {
            SMALLEST_KINDS: PolicyFootprint(SMALLEST_KINDS, self.config, batch_size, smallest_traces, max_seq_len)
        }
        self.method = (
            f"every policy from fresh fake-tensor profiles of that policy (blocks of {FIT_COUNT} and {FIT_COUNT + 1} "
            f"layers, the bottom one {BOTTOM_FIT_COUNT} and {BOTTOM_FIT_COUNT + 1}, "
            f"{plan.seq_lens[0]:,} and {plan.seq_lens[1]:,} tokens, closed form in the block sizes, "
            "tokens and chunk rows)"
        )
        self.facts = ModelFacts.of(profiler_for(1.0, BASE_CHUNKS).model(depth))
        self.flops = self.facts.flops
        self._profiles: dict[int, MemoProfile] = {}
        self._memories: dict[tuple[PolicyShape, int], tuple[Peak, Peak]] = {}  # memory() of this question

    def __getstate__(self) -> dict[str, Any]:
        """What is fitted (the closed forms of every block structure profiled, the solver's per-token bytes, the
        model's facts), without what belongs to one question (profilers, runner, the rank's adjustments, GPU):
        :meth:`rebind` sets those again."""
        state = dict(self.__dict__)
        for name in ("_policy_profiler_for", "run_jobs", "_adjust", "_restate", "gpu"):
            state[name] = None
        state["_profiles"], state["_memories"] = {}, {}
        return state

    def rebind(
        self,
        gpu: Gpu,
        adjust: Callable[[Peak, int], tuple[Peak, int]] | None,
        restate: Restate | None,
        policy_profiler_for: Callable[[MemoryPolicy, Chunks], StepProfiler],
        run_jobs: Runner = _run_here,
    ) -> MemoModel:
        """This model answering another question of the same fit (same model, setup and sequence parallelism): its
        GPU's cost model, a rank's model states (``adjust``, ``restate``: see the constructor) and the profilers of
        further block structures. The solver's views of lengths asked before are dropped (they depend on these)."""
        self.gpu, self._adjust, self._restate = gpu, adjust, restate
        self._policy_profiler_for, self.run_jobs = policy_profiler_for, run_jobs
        self._profiles, self._memories = {}, {}
        return self

    @property
    def block_structures(self) -> int:
        """How many block structures (kinds of policies) have a closed form so far."""
        return len(self._footprints)

    @staticmethod
    def jobs(
        profiler_for: Callable[[float, Chunks], StepProfiler],
        policy_profiler_for: Callable[[MemoryPolicy, Chunks], StepProfiler],
        max_seq_len: int = 1 << 24,
    ) -> list[Callable[[], AllocationTrace]]:
        """The profiles the model is made of, as jobs: the smallest MEMO policy at alpha 0 and at alpha 1 (at the
        shallower profile depth and the longer length: the bytes per token of what alpha keeps), then the smallest
        policies' fit."""
        plan = ProfilePlan.of(profiler_for(0.0, BASE_CHUNKS), "memo", max_seq_len)
        point = (plan.depths[0], plan.seq_lens[-1], BASE_CHUNKS)
        costs = [partial(trace_at, partial(profiler_for, fraction), point) for fraction in (0.0, 1.0)]
        return costs + fit_jobs(policy_profiler_for, SMALLEST_KINDS, max_seq_len)

    def footprint_of(self, shape: PolicyShape) -> PolicyFootprint:
        """The closed form of the policies made of ``shape``'s blocks (profiled the first time it is asked for)."""
        if shape.kinds not in self._footprints:
            traces = self.run_jobs(fit_jobs(self._policy_profiler_for, shape.kinds, self._max_seq_len))
            config = self.config
            self._footprints[shape.kinds] = PolicyFootprint(
                shape.kinds, config, self._batch_size, traces, self._max_seq_len
            )
        return self._footprints[shape.kinds]

    def memory(self, policy: MemoryPolicy | PolicyShape, seq_len: int) -> tuple[Peak, Peak]:
        """``(device, host)`` peaks of one rank's step of ``seq_len`` positions (bucketed like the runtime) under
        ``policy``, from that policy's profiles; model states as the ranks hold them (host: offloaded ones, as
        ``"optimizer"``)."""
        shape = policy if isinstance(policy, PolicyShape) else PolicyShape.of(policy)
        seq_len = bucket_length(seq_len)
        if (shape, seq_len) not in self._memories:  # every length of a bucket, and the searches ask many, is its one
            device, host = self.footprint_of(shape).peaks(shape, seq_len, restate=self._restate)
            state_host = 0
            if self._adjust is not None:
                device, state_host = self._adjust(device, seq_len)
            by_category = dict(host.by_category)
            by_category["optimizer"] += state_host
            host = Peak(host.total + state_host, by_category, host.index, host.phase)
            self._memories[shape, seq_len] = device, host
        return self._memories[shape, seq_len]

    def profile(self, seq_len: int) -> MemoProfile:
        """The solver's view of the memo mode for steps of ``seq_len`` positions (one rank's): that of the longest
        step of their length bucket, for which the runtime decides its policy and sizes its buffers (see
        :mod:`hf_memo.runtime.buckets`), so the step fits whenever that one does."""
        seq_len = bucket_length(seq_len)
        if seq_len in self._profiles:
            return self._profiles[seq_len]
        # S_in and S_attn from the shapes: the layer input (B, S, H), the attention output (B, S, h * D) and its fp32
        # statistics (B, h, S); the solver's cost model only (memory is profiled)
        text = self.config.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        element = self.facts.element_size  # activations' dtype
        tokens = self._batch_size * seq_len
        input_bytes = float(tokens * text.hidden_size * element)
        k = self.sequence_parallel  # a rank runs 1/K of the FLOPs of the whole sequence, the busiest more attention
        whole = self.flops.seconds(
            self._batch_size, seq_len * k, self.gpu.peak_flops, attention_imbalance(self.config, k)
        )
        forward, backward, attention = (t / k for t in whole)
        # Where the executor runs a layer's backward in blocks of queries (memory unplanned), the layer below is
        # fetched ahead only as far as the keys' gradient sums (float32 for half inputs) give memory back, and a
        # kept output is read chunk by chunk.
        blocked = backward_in_blocks(text, seq_len, k)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        sums = tokens * kv_heads * 2 * head_dim * max(element, 4)
        costs = LayerCosts(
            input_bytes=input_bytes,
            attention_bytes=float(tokens * heads * (head_dim * element + 4)),
            other_bytes=self._other_per_token * tokens,
            forward_seconds=forward,
            backward_seconds=backward,
            attention_seconds=attention,
            other_seconds=forward - attention,
            **fetch_split(blocked, sums, tokens * heads * head_dim * element),
        )
        smallest = smallest_policy(self.layers, 2)
        device, host = self.memory(smallest, seq_len)
        kept = policy_memory(smallest.policy().layers, costs)[0]
        state_host = host.by_category["optimizer"]
        self._profiles[seq_len] = MemoProfile(seq_len, device.total - kept, costs, state_host)
        return self._profiles[seq_len]

    def _usage(self, budget: Budget, device: Peak, host: Peak, state_host: int) -> dict[str, float]:
        return budget.shares(device.total, host.total, host.total - state_host)

    def smallest_usage(self, seq_len: int, budget: Budget) -> tuple[float, str]:
        """The smallest ``max`` of the device, host and pinned shares of the smallest policies (``X`` only, alpha 0,
        any number of the top layers on the device, at least one layer on the host), each from its own profile (the
        search's measure of fitting), and the constraint that sets it."""
        state_host = self.profile(seq_len).state_host
        best, binding = float("inf"), "device"
        for on_device in range(min(2, self.layers - 1), self.layers):
            device, host = self.memory(smallest_policy(self.layers, on_device), seq_len)
            shares = self._usage(budget, device, host, state_host)
            name = max(shares, key=shares.__getitem__)
            if shares[name] < best:
                best, binding = shares[name], name
        return best, binding

    def choose(self, seq_len: int, budget: Budget) -> MemoChoice:
        """The fastest policy the solver finds whose own profile fits at ``seq_len``, or why none does."""
        profile = self.profile(seq_len)
        device_room = max(budget.device - profile.base_bytes, 0.0)
        host_room = budget.stash_room(profile.state_host)
        smallest = self.memory(smallest_policy(self.layers, 2), seq_len)
        steps = alpha_steps(self.config, self._batch_size, bucket_length(seq_len))
        for _ in range(REFINES):
            try:
                policy = solve_policy(
                    self.layers, profile.costs, self.gpu.host_bandwidth, device_room, host_room, steps
                )
            except PolicyDoesNotFit as error:
                return self._smallest_fitting(seq_len, budget, profile) or MemoChoice(None, *smallest, str(error))
            device, host = self.memory(policy, seq_len)
            shares = self._usage(budget, device, host, profile.state_host)
            if max(shares.values()) <= 1:
                return MemoChoice(policy, device, host)
            stash = host.total - profile.state_host
            host_over = max(
                0.0 if budget.host is None else host.total - budget.host,
                0.0 if budget.pinned is None else stash - budget.pinned,
            )
            device_room -= max(device.total - budget.device, 0.0) + (1.0 if device.total > budget.device else 0.0)
            host_room -= host_over + (1.0 if host_over > 0 else 0.0)
            if device_room < 0 or host_room < 0:
                break
        return self._smallest_fitting(seq_len, budget, profile) or MemoChoice(None, *smallest, NO_FIT_ONCE_PROFILED)

    def _smallest_fitting(self, seq_len: int, budget: Budget, profile: MemoProfile) -> MemoChoice | None:
        """The fastest of the smallest policies (``X`` only, alpha 0) whose own profile fits, when the solver's cost
        model found none (its room is the two-device-layer policy's; more layers on the device take less pinned
        memory): what the search for the longest length counts as fitting. ``None`` if none fits."""
        for on_device in range(self.layers - 1, min(2, self.layers - 1) - 1, -1):  # fewest copies first
            shape = smallest_policy(self.layers, on_device)
            device, host = self.memory(shape, seq_len)
            if max(self._usage(budget, device, host, profile.state_host).values()) <= 1:
                layers = shape.policy().layers
                seconds = policy_seconds(layers, profile.costs, self.gpu.host_bandwidth)
                return MemoChoice(MemoryPolicy(layers, seconds), device, host)
        return None
