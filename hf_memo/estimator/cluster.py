"""A multi-GPU job as the estimator sees it: ranks, nodes, ZeRO settings, Ulysses buffers, reserves and host memory.

A job runs on ``num_gpus`` ranks, ``gpus_per_node`` of them per node sharing its host memory. Ulysses sequence
parallelism over ``sequence_parallel = K`` ranks gives each rank ``S / K`` positions of every sequence: its
activations are those of a single-GPU step on ``S / K`` tokens (attention runs on all ``S`` positions of ``⌈h/K⌉`` or
``⌊h/K⌋`` heads, about the same bytes), plus what the all-to-all exchanges of hf_memo's Ulysses core hold on the rank
with the most heads, which bounds the step (:func:`all_to_all_bytes`). Each rank's model states are in
:mod:`hf_memo.estimator.model_states`.

Reserves (the command line's defaults below): the CUDA context, NCCL and allocator fragmentation come off each GPU's
memory; an OS/process reserve off each node's host memory, of which a fraction may be pinned (DeepSpeed pins its
offloaded states, hf_memo its stashes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hf_memo.parallel.heads import HeadSplit

if TYPE_CHECKING:
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
