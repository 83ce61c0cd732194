"""Per-rank memory of a multi-GPU job: ZeRO-sharded model states, sequence-parallel activations, host per node.

A job runs on ``num_gpus`` ranks, ``gpus_per_node`` of them per node sharing its host memory. Ulysses sequence
parallelism over ``sequence_parallel = K`` ranks gives each rank ``S / K`` positions of every sequence: its
activations are those of a single-GPU step on ``S / K`` tokens (attention runs on all ``S`` positions of ``h / K``
heads, the same bytes), plus the all-to-all buffers that re-lay out q, k, v and the attention output in each
decoder layer (k and v replicated up to ``K`` heads when ``K`` exceeds the key-value heads). ZeRO shards over
all ranks: stage 1 the optimizer state, stage 2 also the gradients (one decoder layer's in flight), stage 3 also
the parameters (two decoder layers' gathered at a time: the running one and the prefetched one).
``offload_optimizer`` keeps the optimizer state and a copy of the gradient shard it updates on the host; with
ZeRO-2 or 3 the device then holds only the gradients in flight (one layer's).

Model states are the profile's (``parameter``, ``gradient``, ``optimizer`` bytes of the single-GPU step: AdamW
with its states in the parameter dtype, as profiled); DeepSpeed's fp32 master weights are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from hf_memo.profiler.analysis import Peak

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Cluster:
    """The ranks of a job and how its model states and sequences are split over them."""

    num_gpus: int = 1
    sequence_parallel: int = 1
    zero: int = 0
    offload_optimizer: bool = False
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("num_gpus", "sequence_parallel", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_gpus % self.sequence_parallel:
            raise ValueError(f"sequence_parallel must divide num_gpus ({self.num_gpus}), got {self.sequence_parallel}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of {', '.join(map(str, ZERO_STAGES))}, got {self.zero!r}")

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing one node's host memory."""
        return min(self.num_gpus, self.gpus_per_node)

    def rank_seq_len(self, seq_len: int) -> int:
        """Positions of each sequence one rank holds (``ceil(S / K)``)."""
        return math.ceil(seq_len / self.sequence_parallel)

    def describe(self) -> str:
        """One line: ranks, sequence parallelism, ZeRO stage, offload."""
        if self.num_gpus == 1 and self.zero == 0 and not self.offload_optimizer:
            return "1 GPU"
        parts = [
            f"{self.num_gpus} GPUs ({self.ranks_per_node} per node)",
            f"sequence parallel {self.sequence_parallel}",
        ]
        parts.append(f"ZeRO-{self.zero}" if self.zero else "no ZeRO")
        if self.offload_optimizer:
            parts.append("optimizer offloaded to the host")
        return ", ".join(parts)


@dataclass(frozen=True)
class ModelStates:
    """Bytes of the whole model's states on one GPU, as the single-GPU profile has them."""

    parameters: int
    gradients: int  # every trainable parameter's gradient
    optimizer: int
    largest_layer_parameters: int  # the largest of a decoder layer, the embedding and the LM head
    largest_layer_gradients: int


def all_to_all_bytes(config: PretrainedConfig, cluster: Cluster, batch_size: int, seq_len: int, element: int) -> int:
    """Bytes of the Ulysses all-to-all outputs one rank holds in a decoder layer: q, k, v and the attention output
    re-laid out (0 without sequence parallelism)."""
    if cluster.sequence_parallel == 1:
        return 0
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    k = cluster.sequence_parallel
    tokens = batch_size * seq_len  # all S positions of h / K heads == S / K positions of h heads
    query = tokens * (heads // k if heads % k == 0 else math.ceil(heads / k)) * head_dim
    key_value = tokens * math.ceil(max(kv_heads, k) / k) * head_dim
    return (2 * query + 2 * key_value) * element


def rank_peak(device: Peak, states: ModelStates, cluster: Cluster, extra_temporary: int = 0) -> tuple[Peak, int]:
    """One rank's device peak from a single-GPU peak at the rank's tokens, and the host bytes its model states take.

    ``device``'s parameter, gradient and optimizer bytes are replaced by the rank's share; ``extra_temporary``
    (all-to-all buffers) is added to its temporaries.
    """
    n, zero = cluster.num_gpus, cluster.zero
    by_category = dict(device.by_category)
    if zero == 3:
        gathered = math.ceil(states.parameters / n) + 2 * states.largest_layer_parameters
        by_category["parameter"] = min(by_category["parameter"], gathered)
    gradient_share = device.by_category["gradient"]
    host = 0
    if zero >= 2:  # reduced to their owner as each layer's backward ends: one layer's in flight
        gradient_share = min(gradient_share, math.ceil(gradient_share / n) + states.largest_layer_gradients)
    optimizer = states.optimizer if zero == 0 else math.ceil(states.optimizer / n)
    if cluster.offload_optimizer:  # the optimizer state and the gradients it steps with live on the host
        host += optimizer + math.ceil(states.gradients / (n if zero >= 2 else 1))
        optimizer = 0
        if zero >= 2:
            gradient_share = min(gradient_share, states.largest_layer_gradients)
    by_category["gradient"] = gradient_share
    by_category["optimizer"] = optimizer
    by_category["temporary"] += extra_temporary
    return replace(device, total=sum(by_category.values()), by_category=by_category), host
