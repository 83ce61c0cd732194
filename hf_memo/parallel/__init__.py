"""Sequence parallelism (DeepSpeed-Ulysses): process groups, head/sequence all-to-all, sharding, loss."""

from hf_memo.parallel.causal_lm import SequenceParallelLM
from hf_memo.parallel.groups import SequenceParallelGroups, check_head_counts, sequence_parallel_groups
from hf_memo.parallel.sharding import SequenceShard, shard_batch
from hf_memo.parallel.ulysses import (
    gather_heads_scatter_sequence,
    replicate_kv_heads,
    scatter_heads_gather_sequence,
    sum_replicated_kv_heads,
)

__all__ = [
    "SequenceParallelGroups",
    "SequenceParallelLM",
    "SequenceShard",
    "check_head_counts",
    "gather_heads_scatter_sequence",
    "replicate_kv_heads",
    "scatter_heads_gather_sequence",
    "sequence_parallel_groups",
    "shard_batch",
    "sum_replicated_kv_heads",
]
