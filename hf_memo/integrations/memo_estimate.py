"""The memo mode in ``hf-memo estimate``: the memory policy the runtime's solver picks, and FLOP-based step times.

The memo executor is profiled on fake tensors with its smallest MEMO policy (every layer but the top two
keeps its input ``X`` and attention output on the host, ``alpha = 0``) and with ``alpha = 1``. From the
profiles at depths 4 and 5 (see :class:`~hf_memo.integrations.setups.Mode`):

- the host bytes one more layer adds are a layer's stash, ``S_in + S_attn`` (``alpha = 0``) and
  ``S_in + S_attn + S_other`` (``alpha = 1``); ``S_in`` is the layer input ``(B, S, H)`` itself;
- the device peak of the full model minus what the profiled policy keeps there (the top two layers'
  stashes and the two copy buffers) is everything else (parameters, gradients, optimizer state and the
  step's workspace): the budget any policy's kept tensors may use is the GPU memory minus that. This
  assumes every kept tensor is alive at the peak, as at the head, where the profiles peak.

Times are FLOP counts at the GPU's bf16 dense peak (an upper bound on speed, so a lower bound on how
much copy time compute can hide): a layer's forward is ``2 * weights * tokens`` plus the causal
attention core ``2 * B * S² * a``; backward twice that (input gradients only for frozen weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from hf_memo.planner.policy import MemoryPolicy
from hf_memo.planner.policy_solver import LayerCosts, PolicyDoesNotFit, solve_policy
from hf_memo.profiler.analysis import Peak, peak
from hf_memo.profiler.extrapolate import extrapolated_peak
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.phases import decoder_layers

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
    device: Peak  # the profiled device peak (smallest MEMO policy)
    base_bytes: float  # device bytes of everything but the kept tensors and copy buffers
    costs: LayerCosts


@dataclass(frozen=True)
class MemoChoice:
    """The memo mode at one length and budget: the policy (``None`` if nothing fits) and memory it needs."""

    policy: MemoryPolicy | None
    device: Peak
    host: Peak
    shortfall: str = ""


class MemoModel:
    """Profiles the memo executor and solves its memory policy at any length and budget.

    Args:
        config_profiler: ``config_profiler(offload_fraction)`` -> a :class:`StepProfiler` of the memo mode with
            that fixed offload fraction and no host limit.
        batch_size: sequences per step.
        gpu: peak FLOP/s and host bandwidth of the cost model.
        allow_x_only: whether layers may keep ``X`` only (not with attention dropout).
    """

    def __init__(
        self,
        config_profiler: Callable[[float], StepProfiler],
        batch_size: int,
        gpu: Gpu,
        allow_x_only: bool,
    ) -> None:
        self._smallest = config_profiler(0.0)
        self._largest = config_profiler(1.0)
        self.layers = self._smallest.layers
        self.batch_size = self._batch_size = batch_size
        shallow, deeper = self._smallest.profile_layers
        self.method = (
            f"profiled {shallow} and {deeper} of {self.layers} layers on fake tensors at alpha 0 and 1, extrapolated "
            "linearly in layers; memo's memory is its chosen policy's"
        )
        self.gpu = gpu
        self.allow_x_only = allow_x_only
        self._profiles: dict[int, MemoProfile] = {}
        self._other_per_token: float | None = None
        self.model = self._smallest.model(self._smallest.profile_layers[0])
        self.flops = LayerFlops.of(self.model)

    def _layer_host_bytes(self, profiler: StepProfiler, seq_len: int) -> tuple[float, Peak, Peak]:
        """Host bytes one more layer adds at ``seq_len``, and the device peaks of the two profiled depths."""
        shallow, deeper = profiler.profile_layers
        small, large = profiler.trace(seq_len, shallow), profiler.trace(seq_len, deeper)
        per_layer = peak(large, "host").total - peak(small, "host").total
        if self.layers <= deeper:
            full = small if self.layers == shallow else profiler.trace(seq_len)
            return per_layer, peak(full, "device"), peak(full, "device")
        return per_layer, extrapolated_peak(small, large, self.layers, "device"), peak(large, "device")

    def profile(self, seq_len: int) -> MemoProfile:
        """The profile at ``seq_len`` (cached); ``S_other`` per token is measured once, at the first length."""
        if seq_len in self._profiles:
            return self._profiles[seq_len]
        fixed, device, _ = self._layer_host_bytes(self._smallest, seq_len)
        if self._other_per_token is None:
            everything, _, _ = self._layer_host_bytes(self._largest, seq_len)
            self._other_per_token = (everything - fixed) / (self._batch_size * seq_len)
        width = self._smallest.config.get_text_config().hidden_size
        element = next(p for p in self.model.parameters() if p.dim() >= 2).element_size()  # activations' dtype
        input_bytes = float(self._batch_size * seq_len * width * element)
        forward, backward, attention = self.flops.seconds(self._batch_size, seq_len, self.gpu.peak_flops)
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
        self._profiles[seq_len] = MemoProfile(seq_len, device, device.total - kept, costs)
        return self._profiles[seq_len]

    def smallest_usage(self, seq_len: int, gpu_bytes: float, host_bytes: float | None) -> float:
        """The smallest ``max(device share, host share)`` of any policy: the search's measure of fitting."""
        profile = self.profile(seq_len)
        stash = profile.costs.stash_bytes(not self.allow_x_only, 0.0)
        n = self.layers
        best = float("inf")
        for on_device in range(min(2, n), n + 1):
            device = profile.base_bytes + on_device * stash + (2 * stash if on_device < n else 0.0)
            host = (n - on_device) * stash
            share = device / gpu_bytes if host_bytes is None else max(device / gpu_bytes, host / max(host_bytes, 1))
            best = min(best, share)
        return best

    def choose(self, seq_len: int, gpu_bytes: float, host_bytes: float | None) -> MemoChoice:
        """The fastest policy that fits at ``seq_len``, or why none does."""
        profile = self.profile(seq_len)
        host_budget = float(host_bytes) if host_bytes is not None else float(2**60)
        try:
            policy = solve_policy(
                self.layers,
                profile.costs,
                self.gpu.host_bandwidth,
                max(gpu_bytes - profile.base_bytes, 0.0),
                host_budget,
                ALPHA_STEPS,
                self.allow_x_only,
            )
        except PolicyDoesNotFit as error:
            return MemoChoice(None, profile.device, Peak(0), str(error))
        by_category = dict(profile.device.by_category)
        by_category["activation"] += round(policy.device_bytes + profile.base_bytes - profile.device.total)
        device = Peak(sum(by_category.values()), by_category, -1, profile.device.phase)
        host = Peak(round(policy.host_bytes), {**dict.fromkeys(by_category, 0), "activation": round(policy.host_bytes)})
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
