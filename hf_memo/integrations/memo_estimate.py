"""The memo mode in ``hf-memo estimate``: the memory policy the runtime's solver picks, and FLOP-based step times.

The memo executor is profiled on fake tensors with its smallest MEMO policy (every layer but the top two
keeps its input ``X`` and attention output on the host, ``alpha = 0``) and with ``alpha = 1``. From the
closed form fitted to profiles at depths 4 and 5 (see :mod:`~hf_memo.integrations.fitted`):

- the host bytes one more layer adds are a layer's stash, ``S_in + S_attn`` (``alpha = 0``) and
  ``S_in + S_attn + S_other`` (``alpha = 1``); ``S_in`` is the layer input ``(B, S, H)`` itself;
- the device peak of the full model minus what the profiled policy keeps there (the top two layers'
  stashes and the two copy buffers) is everything else (parameters, gradients, optimizer state and the
  step's workspace): the budget any policy's kept tensors may use is the GPU memory minus that. This
  assumes every kept tensor is alive at the peak, as at the head, where the profiles peak.

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

from torch import nn

from hf_memo.integrations.fitted import BASE_CHUNKS, FittedFootprint, ProfilePlan, trace_at
from hf_memo.integrations.setups import Chunks
from hf_memo.planner.policy import MemoryPolicy
from hf_memo.planner.policy_solver import LayerCosts, PolicyDoesNotFit, solve_policy
from hf_memo.profiler.analysis import Peak, peak
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.phases import decoder_layers
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.runtime.buckets import bucket_length

ALPHA_STEPS = 16  # the alpha grid the estimator solves on (the executor rounds down to its chunks)


@dataclass(frozen=True)
class Gpu:
    """What the cost model needs of a GPU: bf16 dense peak FLOP/s and host<->device bytes/s per direction."""

    name: str
    peak_flops: float
    host_bandwidth: float


# Peak: vendor data sheets (see hf_memo.integrations.flops). Bandwidth: a pinned-copy rate well below the
# PCIe link's (Gen5 x16: 64 GB/s) so that the predicted copy exposure is not optimistic.
GPUS = {
    "h100": Gpu("H100 SXM", 989e12, 25e9),
    "h200": Gpu("H200 SXM", 989e12, 25e9),
    "a100": Gpu("A100", 312e12, 12.5e9),
}
DEFAULT_GPU = "h100"


@dataclass(frozen=True)
class LayerFlops:
    """FLOP counts of one decoder layer on ``tokens`` tokens in sequences of ``seq_len``."""

    matmul_weights: int  # elements of the layer's weights taking part in matrix products
    trainable_weights: int
    attention_width: int  # heads x head dimension

    @classmethod
    def of(cls, model: nn.Module) -> LayerFlops:
        """Counts of the first decoder layer of ``model`` (a ``*ForCausalLM`` or a PEFT model around one)."""
        layer = decoder_layers(model)[0]
        weights = [p for p in layer.parameters() if p.dim() >= 2]
        text = (model.config if hasattr(model, "config") else model.get_base_model().config).get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(
            sum(p.numel() for p in weights),
            sum(p.numel() for p in weights if p.requires_grad),
            text.num_attention_heads * head_dim,
        )

    def seconds(self, batch_size: int, seq_len: int, peak_flops: float) -> tuple[float, float, float]:
        """``(T_f, T_b, T_attn)``: forward, backward (no recompute) and the attention core's forward."""
        tokens = batch_size * seq_len
        attention = 2.0 * batch_size * seq_len * seq_len * self.attention_width  # causal QK^T and PV
        matmul = 2.0 * self.matmul_weights * tokens
        weight_grads = 2.0 * self.trainable_weights * tokens
        return (
            (matmul + attention) / peak_flops,
            (matmul + weight_grads + 2 * attention) / peak_flops,
            (attention / peak_flops),
        )


@dataclass(frozen=True)
class MemoProfile:
    """What the memo mode's profile at one length gives the solver."""

    seq_len: int
    device: Peak  # the profiled device peak (smallest MEMO policy), one rank's
    base_bytes: float  # device bytes of everything but the kept tensors and copy buffers
    costs: LayerCosts
    state_host: int = 0  # host bytes of the rank's offloaded model states (optimizer offload)


@dataclass(frozen=True)
class Budget:
    """One rank's memory: device bytes, its share of the node's host memory and of what may be pinned there
    (``None``: no limit)."""

    device: float
    host: float | None = None
    pinned: float | None = None

    def shares(self, device: float, host: float, pinned: float) -> dict[str, float]:
        """The fraction of each budget used (``"device"``, ``"host"``, ``"pinned"``; unlimited ones left out)."""
        shares = {"device": device / self.device}
        if self.host is not None:
            shares["host"] = host / max(self.host, 1.0)
        if self.pinned is not None:
            shares["pinned"] = pinned / max(self.pinned, 1.0)
        return shares

    def stash_room(self, state_host: float) -> float:
        """Host bytes offloaded activations may take beside ``state_host`` bytes of offloaded model states."""
        room = float(2**60)
        if self.host is not None:
            room = min(room, self.host - state_host)
        if self.pinned is not None:
            room = min(room, self.pinned)
        return max(room, 0.0)


@dataclass(frozen=True)
class MemoChoice:
    """The memo mode at one length and budget: the policy (``None`` if nothing fits) and memory it needs."""

    policy: MemoryPolicy | None
    device: Peak
    host: Peak
    shortfall: str = ""


class MemoModel:
    """Profiles the memo executor and solves its memory policy at any length and budget.

    The smallest MEMO policy (``alpha = 0``) is profiled as a :class:`~hf_memo.integrations.fitted.FittedFootprint`
    (six fresh profiles, a closed form in the step's sizes), and once more with ``alpha = 1`` for the bytes per
    token of everything else a layer saves (``S_other``, a constant per token).

    Args:
        profiler_for: ``profiler_for(offload_fraction, chunks)`` -> a fresh-model :class:`StepProfiler` of the memo
            mode with that fixed offload fraction, those chunk settings and no host limit.
        batch_size: sequences per step.
        gpu: peak FLOP/s and host bandwidth of the cost model.
        max_seq_len: the longest length the model's positions allow.
        sequence_parallel: ranks ``K`` a sequence is split over: profiles are of one rank's ``S / K`` tokens, FLOPs
            of one rank's share.
        adjust: ``adjust(device_peak, seq_len)`` -> ``(rank's device peak, host bytes of its model states)`` (see
            :func:`~hf_memo.integrations.cluster.rank_peak`); by default the single-GPU peak, nothing on the host.
        traces: the results of :meth:`jobs` in their order, if they were run already (e.g. side by side with other
            modes' profiles); by default they are run here, one after the other.
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
    ) -> None:
        if traces is None:
            traces = [job() for job in self.jobs(profiler_for, max_seq_len)]
        *smallest, largest_trace = traces
        self.fitted = FittedFootprint(lambda chunks: profiler_for(0.0, chunks), "memo", max_seq_len, smallest)
        self.layers = self.fitted.layers
        if self.layers < 3:
            raise ValueError(f"the memo mode's estimate needs a model of at least 3 layers, got {self.layers}")
        self.batch_size = self._batch_size = batch_size
        self.sequence_parallel = sequence_parallel
        self.gpu = gpu
        self._adjust = adjust
        depth, seq_len = self.fitted.depths[0], self.fitted.seq_lens[-1]
        everything = peak(largest_trace, "host").total
        fixed = peak(self.fitted.trace(depth, seq_len, BASE_CHUNKS), "host").total
        self._other_per_token = (everything - fixed) / ((depth - 2) * batch_size * seq_len)
        self.method = f"{self.fitted.method} at alpha 0, one more at alpha 1; memo's memory is its chosen policy's"
        self.model = profiler_for(1.0, BASE_CHUNKS).model(depth)
        self.flops = LayerFlops.of(self.model)
        self._profiles: dict[int, MemoProfile] = {}

    @staticmethod
    def jobs(
        profiler_for: Callable[[float, Chunks], StepProfiler], max_seq_len: int = 1 << 24
    ) -> list[Callable[[], AllocationTrace]]:
        """The profiles the model is fitted to, as jobs: the closed form's at alpha 0, then one at alpha 1 (at the
        shallower depth and the longer length)."""

        def at_alpha(fraction: float) -> Callable[[Chunks], StepProfiler]:
            return partial(profiler_for, fraction)

        plan = ProfilePlan.of(profiler_for(0.0, BASE_CHUNKS), "memo", max_seq_len)
        largest = (plan.depths[0], plan.seq_lens[-1], BASE_CHUNKS)
        return plan.jobs(at_alpha(0.0)) + [partial(trace_at, at_alpha(1.0), largest)]

    def fixed_bytes(self, seq_len: int) -> float:
        """``S_in + S_attn``: host bytes one more swapped layer adds at ``seq_len`` (smallest MEMO policy)."""
        if len(self.fitted.depths) > 1:
            more = self.fitted.footprint(seq_len, self.layers + 1).host.total
            return float(more - self.fitted.footprint(seq_len).host.total)
        return self.fitted.footprint(seq_len).host.total / (self.layers - 2)

    def profile(self, seq_len: int) -> MemoProfile:
        """The closed form's memo profile for steps of ``seq_len`` positions (one rank's): that of the longest step of
        their length bucket, for which the runtime decides its policy and sizes its buffers (see
        :mod:`hf_memo.runtime.buckets`), so the step fits whenever that one does."""
        seq_len = bucket_length(seq_len)
        if seq_len in self._profiles:
            return self._profiles[seq_len]
        device, state_host = self.fitted.footprint(seq_len).device, 0
        if self._adjust is not None:
            device, state_host = self._adjust(device, seq_len)
        fixed = self.fixed_bytes(seq_len)
        text = self.fitted.config.get_text_config()
        element = next(p for p in self.model.parameters() if p.dim() >= 2).element_size()  # activations' dtype
        input_bytes = float(self._batch_size * seq_len * text.hidden_size * element)
        k = self.sequence_parallel  # a rank runs 1/K of the FLOPs of the whole sequence
        whole = self.flops.seconds(self._batch_size, seq_len * k, self.gpu.peak_flops)
        forward, backward, attention = (t / k for t in whole)
        costs = LayerCosts(
            input_bytes=input_bytes,
            attention_bytes=fixed - input_bytes,
            other_bytes=self._other_per_token * self._batch_size * seq_len,
            forward_seconds=forward,
            backward_seconds=backward,
            attention_seconds=attention,
            other_seconds=forward - attention,
        )
        kept = (min(2, self.layers) + (2 if self.layers > 2 else 0)) * fixed  # top two + two copy buffers
        self._profiles[seq_len] = MemoProfile(seq_len, device, device.total - kept, costs, state_host)
        return self._profiles[seq_len]

    def smallest_usage(self, seq_len: int, budget: Budget) -> tuple[float, str]:
        """The smallest ``max`` of the device, host and pinned shares of any policy (the search's measure of fitting),
        and the constraint that sets it."""
        profile = self.profile(seq_len)
        stash = profile.costs.stash_bytes(False, 0.0)  # X only, alpha 0: the smallest stash
        n = self.layers
        best, binding = float("inf"), "device"
        for on_device in range(min(2, n), n + 1):
            device = profile.base_bytes + on_device * stash + (2 * stash if on_device < n else 0.0)
            swapped = (n - on_device) * stash
            shares = budget.shares(device, swapped + profile.state_host, swapped)
            name = max(shares, key=shares.__getitem__)
            if shares[name] < best:
                best, binding = shares[name], name
        return best, binding

    def choose(self, seq_len: int, budget: Budget) -> MemoChoice:
        """The fastest policy that fits at ``seq_len``, or why none does."""
        profile = self.profile(seq_len)
        host_budget = budget.stash_room(profile.state_host)
        try:
            policy = solve_policy(
                self.layers,
                profile.costs,
                self.gpu.host_bandwidth,
                max(budget.device - profile.base_bytes, 0.0),
                host_budget,
                ALPHA_STEPS,
            )
        except PolicyDoesNotFit as error:
            return MemoChoice(None, profile.device, Peak(0), str(error))
        by_category = dict(profile.device.by_category)
        by_category["activation"] += round(policy.device_bytes + profile.base_bytes - profile.device.total)
        device = Peak(sum(by_category.values()), by_category, -1, profile.device.phase)
        host_total = round(policy.host_bytes) + profile.state_host
        host = Peak(
            host_total,
            {**dict.fromkeys(by_category, 0), "activation": round(policy.host_bytes), "optimizer": profile.state_host},
        )
        return MemoChoice(policy, device, host)


def step_seconds(
    mode: str, flops: LayerFlops, layers: int, head_seconds: float, batch_size: int, seq_len: int, gpu: Gpu
) -> float:
    """FLOP-based step time of a mode that does not offload: ``vanilla`` keeps everything, the others
    recompute every decoder layer's forward in backward (Hugging Face checkpointing)."""
    forward, backward, _ = flops.seconds(batch_size, seq_len, gpu.peak_flops)
    recompute = 0.0 if mode == "vanilla" else forward
    return layers * (forward + backward + recompute) + head_seconds


def head_seconds(model: nn.Module, batch_size: int, seq_len: int, gpu: Gpu) -> float:
    """FLOP-based seconds of the LM head's forward and backward."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return 0.0
    weights = head.weight.numel()
    factor = 6.0 if head.weight.requires_grad else 4.0
    return factor * weights * batch_size * seq_len / gpu.peak_flops


def model_flops(flops: LayerFlops, layers: int, head: float, batch_size: int, seq_len: int, gpu: Gpu) -> float:
    """Model FLOPs of the step (no recompute): what MFU counts."""
    forward, backward, _ = flops.seconds(batch_size, seq_len, gpu.peak_flops)
    return (layers * (forward + backward) + head) * gpu.peak_flops


def gpu_of(name: str) -> Gpu:
    """The cost model's GPU called ``name`` (``"h100"``, ``"h200"``, ``"a100"``)."""
    if name.lower() not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)}, got {name!r}")
    return GPUS[name.lower()]
