"""The time model: a step's FLOPs at a GPU's bf16 dense peak plus the host copies compute cannot hide.

Times are lower bounds (no kernel reaches the peak; communication is not counted): a layer's forward is
``2 * weights * tokens`` plus the causal attention core ``2 * B * S² * a``, its backward twice that (input
gradients only for frozen weights); each mode recomputes what it drops. Under sequence parallelism the busiest
rank's attention (an uneven head split) sets the pace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_memo.estimator.setups import DEPRECATED_MODES, MODES
from hf_memo.parallel.heads import HeadSplit

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig


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
        from hf_memo.profiler.phases import decoder_layers

        layer = decoder_layers(model)[0]
        weights = [p for p in layer.parameters() if p.dim() >= 2]
        text = (model.config if hasattr(model, "config") else model.get_base_model().config).get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(
            sum(p.numel() for p in weights),
            sum(p.numel() for p in weights if p.requires_grad),
            text.num_attention_heads * head_dim,
        )

    def seconds(
        self, batch_size: int, seq_len: int, peak_flops: float, attention_scale: float = 1.0
    ) -> tuple[float, float, float]:
        """``(T_f, T_b, T_attn)``: forward, backward (no recompute) and the attention core's forward, the attention
        core's FLOPs times ``attention_scale`` (the busiest rank's share under sequence parallelism:
        :func:`attention_imbalance`)."""
        tokens = batch_size * seq_len
        attention = 2.0 * batch_size * seq_len * seq_len * self.attention_width * attention_scale  # QK^T and PV
        matmul = 2.0 * self.matmul_weights * tokens
        weight_grads = 2.0 * self.trainable_weights * tokens
        return (
            (matmul + attention) / peak_flops,
            (matmul + weight_grads + 2 * attention) / peak_flops,
            (attention / peak_flops),
        )


@dataclass(frozen=True)
class ModelFacts:
    """What the step-time bound and a rank's accounting read off a (fake) copy of the trained model, kept beside a
    closed form so that a cached one answers without building the model again."""

    element_size: int  # bytes of one element of the weights (and so of the activations)
    flops: LayerFlops  # of one decoder layer
    head_weights: int  # elements of the LM head's weight (0: no output embedding)
    head_trainable: bool  # whether the LM head's weight takes gradients

    @classmethod
    def of(cls, model: nn.Module) -> ModelFacts:
        """The facts of ``model`` (a ``*ForCausalLM`` or a PEFT model around one)."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return cls(
            next(p for p in model.parameters() if p.dim() >= 2).element_size(),
            LayerFlops.of(model),
            0 if head is None else head.weight.numel(),
            head is not None and head.weight.requires_grad,
        )

    def head_seconds(self, batch_size: int, seq_len: int, gpu: Gpu) -> float:
        """FLOP-based seconds of the LM head's forward and backward on ``(batch_size, seq_len)`` tokens."""
        factor = 6.0 if self.head_trainable else 4.0
        return factor * self.head_weights * batch_size * seq_len / gpu.peak_flops


def attention_imbalance(config: PretrainedConfig, ranks: int) -> float:
    """How much longer than an even split attention takes on the busiest of ``ranks`` sequence-parallel ranks:
    ``⌈h/P⌉ / (h/P)`` (:class:`~hf_memo.parallel.heads.HeadSplit`), 1 on one rank."""
    if ranks == 1:
        return 1.0
    text = config.get_text_config()
    heads = text.num_attention_heads
    return HeadSplit(heads, getattr(text, "num_key_value_heads", None) or heads, ranks).imbalance


def step_seconds(
    mode: str,
    flops: LayerFlops,
    layers: int,
    head_seconds: float,
    batch_size: int,
    seq_len: int,
    gpu: Gpu,
    attention_scale: float = 1.0,
) -> float:
    """FLOP-based step time of a mode that does not offload: ``vanilla`` keeps everything, the others
    recompute every decoder layer's forward in backward (Hugging Face checkpointing); attention's FLOPs times
    ``attention_scale`` (see :meth:`LayerFlops.seconds`)."""
    forward, backward, _ = flops.seconds(batch_size, seq_len, gpu.peak_flops, attention_scale)
    recompute = forward if MODES[DEPRECATED_MODES.get(mode, (mode,))[0]].recomputes_layers else 0.0
    return layers * (forward + backward + recompute) + head_seconds


def head_seconds(model: nn.Module, batch_size: int, seq_len: int, gpu: Gpu) -> float:
    """FLOP-based seconds of the LM head's forward and backward (see :meth:`ModelFacts.head_seconds`)."""
    return ModelFacts.of(model).head_seconds(batch_size, seq_len, gpu)


def model_flops(flops: LayerFlops, layers: int, head: float, batch_size: int, seq_len: int, gpu: Gpu) -> float:
    """Model FLOPs of the step (no recompute): what MFU counts."""
    forward, backward, _ = flops.seconds(batch_size, seq_len, gpu.peak_flops)
    return (layers * (forward + backward) + head) * gpu.peak_flops


def gpu_of(name: str) -> Gpu:
    """The cost model's GPU called ``name`` (``"h100"``, ``"h200"``, ``"a100"``)."""
    if name.lower() not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)}, got {name!r}")
    return GPUS[name.lower()]
