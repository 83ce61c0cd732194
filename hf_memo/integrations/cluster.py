"""Per-rank memory of a multi-GPU job: DeepSpeed's model states, Ulysses buffers, reserves and host memory per node.

A job runs on ``num_gpus`` ranks, ``gpus_per_node`` of them per node sharing its host memory. Ulysses sequence
parallelism over ``sequence_parallel = K`` ranks gives each rank ``S / K`` positions of every sequence: its
activations are those of a single-GPU step on ``S / K`` tokens (attention runs on all ``S`` positions of ``⌈h/K⌉`` or
``⌊h/K⌋`` heads, about the same bytes), plus what the all-to-all exchanges of hf_memo's Ulysses core hold on the rank
with the most heads, which bounds the step (:func:`all_to_all_bytes`).

Without ZeRO the model states are the profile's (AdamW on the model's own weights, its moments in the parameter
dtype: what a plain PyTorch or Hugging Face run of a bf16 model does). With ZeRO they are DeepSpeed's, counted from
its sources (``runtime/zero/stage_1_and_2.py``, ``stage3.py``, ``partitioned_param_coordinator.py``, DeepSpeed 0.19)
for the setup a user runs (:class:`DeepSpeedConfig`): bf16 mixed precision with fp32 master weights, gradient
partition and AdamW moments by default, sharded over all ``N`` ranks; bf16 weights on the device; per rank
(``T`` trainable elements, ``P`` all, ``e`` bytes per weight, ``/N`` the rank's partition):

- ZeRO-1: ``e P`` weights, ``e T`` gradients (kept whole until the step) and the reduce bucket, ``12 T / N`` master
  weights and moments;
- ZeRO-2: the gradient partition ``e T / N``, the running region's gradients before they reach the bucket, the
  reduce bucket (two with ``overlap_comm``); at the step the fp32 copy of the partition, ``4 T / N``, too;
- ZeRO-3: the small parameters every rank keeps whole (``stage3_param_persistence_threshold``), a partition of the
  others and the gathered ones (the running region and its prefetch, up to ``stage3_max_live_parameters``), the
  bf16 gradient partition, one reduce bucket and the fp32 gradient buffer of the largest sub-group beside ``12 T / N``;
- ``offload_optimizer``: master weights, fp32 gradients and moments, ``16 T / N``, plus bf16 staging buffers
  (``e T / N``) live on the host, pinned except the moments; the device keeps only the gradients in flight.

Reserves (the command line's defaults below): the CUDA context, NCCL and allocator fragmentation come off each GPU's
memory; an OS/process reserve off each node's host memory, of which a fraction may be pinned (DeepSpeed pins its
offloaded states, hf_memo its stashes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from hf_memo.parallel.heads import HeadSplit
from hf_memo.profiler.analysis import Peak
from hf_memo.profiler.trace import CATEGORIES

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

ZERO_STAGES = (0, 1, 2, 3)
GiB = 1 << 30
FP32 = 4
LSE_BYTES = 4  # the attention's log-sum-exp statistics are fp32
# Kept off each GPU by default (--reserve): the CUDA context with its cuBLAS workspaces (~0.6 GiB on an H100 with
# CUDA 12), NCCL's buffers for the few communicators DeepSpeed and Ulysses open (~1 GiB; NVLink SHARP needs more)
# and what the caching allocator holds but cannot hand out at the peak (~1.4 GiB, under 2% of an 80 GiB card).
DEVICE_RESERVE = 3 * GiB
# Kept off each node's host memory by default (--host-reserve): the OS, and each rank's process (Python, PyTorch's
# and CUDA's libraries and host-side state, DeepSpeed, data loading).
HOST_RESERVE_NODE = 8 * GiB
HOST_RESERVE_PER_RANK = 4 * GiB
# Of the host memory left after the reserve, the share that may be pinned by default (--pinned-memory): pinned pages
# cannot be reclaimed or swapped, and the page cache, data loading and pageable allocations (DeepSpeed's AdamW
# moments are pageable) need the rest.
PINNABLE_FRACTION = 0.75


@dataclass(frozen=True)
class DeepSpeedConfig:
    """The DeepSpeed settings model states depend on: DeepSpeed's defaults (``runtime/zero/config.py``).

    Attributes:
        reduce_bucket_size: elements of a gradient reduce bucket (``reduce_bucket_size``).
        overlap_comm: two reduce buckets under ZeRO-1/2 (``overlap_comm``; ``None``: DeepSpeed's default, on for
            ZeRO-3 only, whose one bucket it does not double).
        prefetch_bucket_size: elements ZeRO-3 gathers ahead of the running module (``stage3_prefetch_bucket_size``).
        max_live_parameters: elements ZeRO-3 may hold gathered before it stops prefetching
            (``stage3_max_live_parameters``).
        param_persistence_threshold: ZeRO-3 keeps parameters of at most this many elements whole on every rank
            (``stage3_param_persistence_threshold``).
        sub_group_size: elements of one ZeRO-3 optimizer sub-group (``sub_group_size``): its fp32 gradient buffer.
        pin_memory: offloaded states in pinned memory (``offload_optimizer.pin_memory``).
        pure_bf16: bf16 master weights, gradients and AdamW moments (``bf16.bf16_master_weights_and_grads`` and
            ``bf16.bf16_optimizer_states``) instead of fp32 ones.
    """

    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    pin_memory: bool = True
    pure_bf16: bool = False

    def reduce_buckets(self, zero: int) -> int:
        """Reduce buckets a rank holds under ZeRO stage ``zero`` (1, 2 or 3)."""
        overlap = zero == 3 if self.overlap_comm is None else self.overlap_comm
        return 2 if overlap and zero < 3 else 1

    def describe(self) -> str:
        """The settings as DeepSpeed names them."""
        precision = "bf16" if self.pure_bf16 else "fp32"
        precision += " master weights, gradients and AdamW moments"
        overlap = "ZeRO-3 only" if self.overlap_comm is None else str(self.overlap_comm).lower()
        return (
            f"{precision}; reduce_bucket_size {_elements(self.reduce_bucket_size)}, overlap_comm {overlap}, "
            f"stage3_prefetch_bucket_size {_elements(self.prefetch_bucket_size)}, "
            f"stage3_max_live_parameters {_elements(self.max_live_parameters)}"
        )


def _elements(count: int) -> str:
    """``500_000_000 -> '5e8'``, as DeepSpeed's configs write element counts."""
    mantissa, exponent = f"{count:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


@dataclass(frozen=True)
class Cluster:
    """The ranks of a job and how its model states and sequences are split over them."""

    num_gpus: int = 1
    sequence_parallel: int = 1
    zero: int = 0
    offload_optimizer: bool = False
    gpus_per_node: int = 8
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    def __post_init__(self) -> None:
        for name in ("num_gpus", "sequence_parallel", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_gpus % self.sequence_parallel:
            raise ValueError(f"sequence_parallel must divide num_gpus ({self.num_gpus}), got {self.sequence_parallel}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of {', '.join(map(str, ZERO_STAGES))}, got {self.zero!r}")
        if self.zero == 0 and (self.offload_optimizer or self.deepspeed.pure_bf16):
            raise ValueError("offload_optimizer and pure_bf16 are DeepSpeed ZeRO settings: zero must be 1, 2 or 3")

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing one node's host memory."""
        return min(self.num_gpus, self.gpus_per_node)

    def rank_seq_len(self, seq_len: int) -> int:
        """Positions of each sequence one rank holds (``ceil(S / K)``)."""
        return math.ceil(seq_len / self.sequence_parallel)

    def describe(self) -> str:
        """One line: ranks, sequence parallelism, ZeRO stage, offload, precision."""
        if self.num_gpus == 1 and self.zero == 0:
            return "1 GPU"
        parts = [
            f"{self.num_gpus} GPU{'s' if self.num_gpus > 1 else ''} ({self.ranks_per_node} per node)",
            f"sequence parallel {self.sequence_parallel}",
        ]
        parts.append(f"ZeRO-{self.zero}" if self.zero else "no ZeRO")
        if self.offload_optimizer:
            parts.append("optimizer offloaded to the host")
        if self.zero:
            parts.append("DeepSpeed " + ("pure bf16" if self.deepspeed.pure_bf16 else "bf16 mixed precision"))
        return ", ".join(parts)


@dataclass(frozen=True)
class ModelStates:
    """Element counts of the whole model's parameters (what DeepSpeed partitions) and the bytes of one element."""

    parameters: int
    trainable: int
    element_size: int
    largest_region: int  # the largest of a decoder layer, the embedding and the LM head: ZeRO-3 gathers one whole
    largest_region_trainable: int  # its trainable elements: the gradients a region's backward hands over at once
    largest_parameter: int
    persistent: int = 0  # elements of the parameters ZeRO-3 keeps whole on every rank
    optimizer: bool = True  # AdamW (False: no optimizer, no master weights or moments)

    @classmethod
    def of(cls, model: nn.Module, num_layers: int, optimizer: bool, persistence_threshold: int) -> ModelStates:
        """The states of ``model`` with ``num_layers`` decoder layers, from a (fake) copy with fewer: its extra layers
        are the first one's. ``model`` is a ``*ForCausalLM`` or a PEFT model around one."""
        from hf_memo.profiler.phases import decoder_layers

        layer = decoder_layers(model)[0]
        extra = num_layers - len(decoder_layers(model))
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        regions = [layer] + [m for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None]

        def whole(keep: Callable[[nn.Parameter], bool] = _any) -> int:
            return _count(model, keep) + extra * _count(layer, keep)

        def small(p: nn.Parameter) -> bool:
            return p.numel() <= persistence_threshold

        return cls(
            parameters=whole(),
            trainable=whole(_trainable),
            element_size=next(p for p in model.parameters() if p.dim() >= 2).element_size(),
            largest_region=max(_count(region) for region in regions),
            largest_region_trainable=max(_count(region, _trainable) for region in regions),
            largest_parameter=max(p.numel() for p in model.parameters()),
            persistent=whole(small),
            optimizer=optimizer,
        )


def _any(parameter: nn.Parameter) -> bool:
    return True


def _trainable(parameter: nn.Parameter) -> bool:
    return parameter.requires_grad


def _count(module: nn.Module, keep: Callable[[nn.Parameter], bool] = _any) -> int:
    """Elements of ``module``'s parameters that ``keep`` accepts (shared ones once)."""
    return sum(p.numel() for p in module.parameters() if keep(p))


@dataclass(frozen=True)
class RankStates:
    """One rank's DeepSpeed model states, in bytes.

    ``gradients`` is what backward holds; ``gradients_before_backward`` what exists from the forward on (buffers
    DeepSpeed allocates once); ``step_gradients`` what the optimizer step holds instead (ZeRO-1/2 on the device: the
    gradient partition and its fp32 copy), when activations are gone.
    """

    parameters: int
    gathered: int  # of the parameters: ZeRO-3's gathered ones
    gradients: int
    gradients_before_backward: int
    buckets: int  # of the gradients: the reduce buckets
    optimizer: int
    step_gradients: int
    host_pinned: int
    host_pageable: int

    @property
    def host(self) -> int:
        """Host bytes of the rank's offloaded states."""
        return self.host_pinned + self.host_pageable

    def device(self, backward: bool) -> int:
        """Device bytes of the states in backward (``backward``) or before it."""
        gradients = self.gradients if backward else self.gradients_before_backward
        return self.parameters + gradients + self.optimizer

    @property
    def step_total(self) -> int:
        """Device bytes of the states at the optimizer step."""
        return self.parameters - self.gathered + self.step_gradients + self.optimizer


def _gathered(states: ModelStates, config: DeepSpeedConfig) -> int:
    """Elements ZeRO-3 holds gathered at once: the running region, and what it prefetches while it runs (a bucket,
    which may overrun by one parameter), never more than ``stage3_max_live_parameters`` in all, nor more than the
    partitioned parameters."""
    region = states.largest_region
    prefetch = min(config.prefetch_bucket_size + states.largest_parameter, max(config.max_live_parameters - region, 0))
    return min(states.parameters - states.persistent, region + prefetch)


def rank_states(states: ModelStates, cluster: Cluster) -> RankStates:
    """One rank's model states under DeepSpeed ZeRO ``cluster.zero`` (1, 2 or 3): see the module docstring."""
    config, zero, e = cluster.deepspeed, cluster.zero, states.element_size
    part = math.ceil(states.trainable / cluster.num_gpus)  # trainable elements of the rank's partition
    master = (e if config.pure_bf16 else FP32) if states.optimizer else 0
    moments = 2 * master
    grad32 = master  # the gradient partition the optimizer steps with, in the master weights' dtype
    buckets = config.reduce_buckets(zero) * config.reduce_bucket_size * e
    in_flight = states.largest_region_trainable * e
    gathered = e * _gathered(states, config) if zero == 3 else 0
    if zero == 3:  # the rank's partition, the parameters kept whole, the gathered ones
        partitioned = states.parameters - states.persistent
        parameters = e * (math.ceil(partitioned / cluster.num_gpus) + states.persistent) + gathered
    else:
        parameters = e * states.parameters
    offload = cluster.offload_optimizer
    partition = 0 if offload else e * part  # bf16 gradient partition on the device (ZeRO-2/3)
    staging = e * states.largest_parameter if offload and zero < 3 else 0  # a gradient on its way to the host
    if zero == 1:
        before, during = staging, e * states.trainable + buckets + staging
    elif zero == 2:
        before, during = staging, partition + in_flight + buckets + staging
    else:
        before = partition + buckets
        during = before + in_flight
    optimizer = 0 if offload else (master + moments) * part
    if zero == 3 and not offload:
        optimizer += grad32 * min(part, config.sub_group_size)
    step = (e + grad32) * part if zero < 3 and not offload else before
    pinned = (master + grad32 + e) * part + staging if offload else 0
    pageable = moments * part if offload else 0
    if not config.pin_memory:
        pinned, pageable = 0, pinned + pageable
    return RankStates(parameters, gathered, during, before, buckets, optimizer, step, pinned, pageable)


class _Tape:
    """Bytes allocated and freed in order, and the most held at once."""

    def __init__(self) -> None:
        self.held = self.peak = 0

    def alloc(self, size: int) -> None:
        self.held += size
        self.peak = max(self.peak, self.held)

    def free(self, size: int) -> None:
        self.held -= size


@dataclass(frozen=True)
class _UlyssesBuffers:
    """What :class:`~hf_memo.parallel.memo_attention.UlyssesAttention` allocates on rank 0 of a
    :class:`~hf_memo.parallel.heads.HeadSplit` (the rank with the most heads), step by step, in bytes.

    ``local(n)``: ``n`` heads of the rank's ``s`` positions; ``whole(n)``: ``n`` heads of all ``S = K s``. q, k, v
    and gradients reach the core as ``(B, n, s, D)`` views of ``(B, s, n, D)`` memory, and its outputs are laid out
    likewise, so every exchange packs what it sends into a buffer of its own; the received buffer is re-laid into a
    new one unless ``B * heads`` (scatter) or ``B`` (gather of a partition of the heads) is 1.
    """

    split: HeadSplit
    batch: int
    positions: int
    head_dim: int
    element: int

    def local(self, heads: int) -> int:
        return self.batch * self.positions * heads * self.head_dim * self.element

    def whole(self, heads: int) -> int:
        return self.split.size * self.local(heads)

    def scatter(self, tape: _Tape, sent: int, heads: int) -> None:
        """Packed send buffer of ``sent`` heads' shards, the received ``heads`` of all positions (re-laid)."""
        tape.alloc(self.local(sent))
        tape.alloc(self.whole(heads))
        tape.free(self.local(sent))
        if self.batch * heads > 1:
            tape.alloc(self.whole(heads))
            tape.free(self.whole(heads))

    def gather(self, tape: _Tape, heads: int, received: int, result: int, partition: bool) -> None:
        """``heads`` of all positions sent back as they are (``B * heads`` 1) or packed, ``received`` heads' shards
        arriving, put together into the ``result`` heads (a view of them for a partition at batch 1)."""
        packed = self.batch * heads > 1
        if packed:
            tape.alloc(self.whole(heads))
        tape.alloc(self.local(received))
        if packed:
            tape.free(self.whole(heads))
        if not (partition and self.batch == 1):
            tape.alloc(self.local(result))
            tape.free(self.local(received))

    def exchange_qkv(self, tape: _Tape) -> tuple[int, int]:
        """q, k, v exchanged (and k, v repeated where the split asks for it); returns q's and k's bytes."""
        split = self.split
        queries, received, attended = len(split.query(0)), len(split.kv(0)), split.attended_kv_heads(0)
        self.scatter(tape, split.heads, queries)
        for _ in "kv":
            self.scatter(tape, sum(map(len, split.kvs)), received)
            if attended != received:
                tape.alloc(self.whole(attended))
                tape.free(self.whole(received))
        return self.whole(queries), self.whole(attended)

    def forward(self) -> int:
        """Peak of the forward beyond the single-GPU core's (its output and statistics at the rank's positions)."""
        split, tape = self.split, _Tape()
        queries = len(split.query(0))
        q, kv = self.exchange_qkv(tape)
        lse = self.batch * self.positions * split.size * queries * LSE_BYTES
        tape.alloc(q + lse)  # the core's output and statistics
        tape.free(q + 2 * kv)
        self.gather(tape, queries, split.heads, split.heads, partition=True)
        return tape.peak - self.local(split.heads) - self.batch * self.positions * split.heads * LSE_BYTES

    def backward(self) -> int:
        """Peak of the backward beyond the single-GPU core's (dq, dk, dv at the rank's positions)."""
        split, tape = self.split, _Tape()
        queries, received, attended = len(split.query(0)), len(split.kv(0)), split.attended_kv_heads(0)
        self.scatter(tape, split.heads, queries)  # the output's gradient
        q, kv = self.exchange_qkv(tape)
        self.scatter(tape, split.heads, queries)  # the output
        tape.alloc(q + 2 * kv)  # dq, dk, dv
        tape.free(2 * q + 2 * kv)  # the exchanged q, k, v and output (the output's gradient stays)
        self.gather(tape, queries, split.heads, split.heads, partition=True)
        tape.free(q)
        kv_partition = sum(map(len, split.kvs)) == split.kv_heads
        for _ in "kv":
            if attended != received:
                tape.alloc(self.whole(received))  # the repeated heads' gradients summed
            self.gather(tape, received, sum(map(len, split.kvs)), split.kv_heads, kv_partition)
            if attended != received:
                tape.free(self.whole(received))
        return tape.peak - self.local(split.heads) - 2 * self.local(split.kv_heads)


def all_to_all_bytes(
    config: PretrainedConfig, cluster: Cluster, batch_size: int, rank_seq_len: int, element: int
) -> int:
    """Bytes hf_memo's Ulysses attention core (:class:`~hf_memo.parallel.memo_attention.UlyssesAttention`) holds
    beyond the single-GPU core on the rank's ``rank_seq_len`` positions (``S / K``), at its worst moment, on the
    rank with the most heads (rank 0 of the :class:`~hf_memo.parallel.heads.HeadSplit`: ``⌈h/K⌉`` query heads and
    the most KV heads), which bounds the step.

    After an exchange a rank holds all ``S`` positions of its query heads and of the KV heads they use (repeated to
    one per query head where the split asks for it). Forward exchanges q, k, v and the output back; backward
    exchanges the output gradient, q, k, v and the output (all alive at the core's backward beside dq, dk, dv in the
    exchanged layout) and the three gradients back, step by step as :class:`_UlyssesBuffers` counts. 0 without
    sequence parallelism. Added to a rank's peak wherever it is, this is an upper bound; it is exact when the step
    peaks in the attention core.
    """
    k = cluster.sequence_parallel
    if k == 1:
        return 0
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    buffers = _UlyssesBuffers(HeadSplit(heads, kv_heads, k), batch_size, rank_seq_len, head_dim, element)
    return max(buffers.forward(), buffers.backward())


def rank_state_bytes(values: np.ndarray, states: ModelStates, cluster: Cluster) -> np.ndarray:
    """Moments' device bytes by category ``(moments, len(CATEGORIES))`` with the model states a DeepSpeed rank holds
    in place of the profile's (the same values without ZeRO): those of backward where a moment holds gradients,
    else those before it. Which moment is the highest depends on it: a profile's own states (full gradients, AdamW
    moments on the device) weigh backward far more than a rank's do."""
    if cluster.zero == 0:
        return values
    ranked = rank_states(states, cluster)
    column = {category: CATEGORIES.index(category) for category in ("parameter", "gradient", "optimizer")}
    restated = values.copy()
    backward = values[:, column["gradient"]] > 0
    restated[:, column["parameter"]] = ranked.parameters
    restated[:, column["gradient"]] = np.where(backward, ranked.gradients, ranked.gradients_before_backward)
    restated[:, column["optimizer"]] = ranked.optimizer
    return restated


def rank_peak(
    device: Peak, states: ModelStates, cluster: Cluster, extra_temporary: int = 0, restated: bool = False
) -> tuple[Peak, int]:
    """One rank's device peak from a single-GPU peak at the rank's tokens, and the host bytes of its model states.

    Without ZeRO the profile's parameter, gradient and optimizer bytes stay; with ZeRO they are DeepSpeed's
    (:func:`rank_state_bytes`; ``restated``: ``device`` holds them already, chosen among moments that did), or the
    optimizer step's if that holds more. ``extra_temporary`` (all-to-all buffers) is added to the temporaries.
    """
    by_category = dict(device.by_category)
    by_category["temporary"] += extra_temporary
    if cluster.zero == 0:
        return replace(device, total=sum(by_category.values()), by_category=by_category), 0
    ranked = rank_states(states, cluster)
    if not restated:
        values = rank_state_bytes(np.array([[by_category[c] for c in CATEGORIES]]), states, cluster)[0]
        by_category = {c: int(v) for c, v in zip(CATEGORIES, values)}
    total = sum(by_category.values())
    if ranked.step_total + by_category["buffer"] > total:
        step = dict.fromkeys(by_category, 0)
        step.update(
            parameter=ranked.parameters - ranked.gathered,
            gradient=ranked.step_gradients,
            optimizer=ranked.optimizer,
            buffer=by_category["buffer"],
        )
        return Peak(sum(step.values()), step, device.index, "optimizer step"), ranked.host
    return replace(device, total=total, by_category=by_category), ranked.host
