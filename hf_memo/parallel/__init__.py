"""Sequence parallelism (DeepSpeed-Ulysses): process groups, head/sequence all-to-all, sharding, loss."""

from hf_memo.parallel.causal_lm import SequenceParallelLM
from hf_memo.parallel.groups import SequenceParallelGroups, sequence_parallel_groups
from hf_memo.parallel.heads import HeadSplit, check_head_counts
from hf_memo.parallel.sharding import SequenceShard, shard_batch
from hf_memo.parallel.ulysses import (
    gather_heads_scatter_sequence,
    repeat_kv_heads,
    scatter_heads_gather_sequence,
    sum_repeated_kv_heads,
)

__all__ = [
    "HeadSplit",
    "SequenceParallelGroups",
    "SequenceParallelLM",
    "SequenceShard",
    "check_head_counts",
    "gather_heads_scatter_sequence",
    "repeat_kv_heads",
    "scatter_heads_gather_sequence",
    "sequence_parallel_groups",
    "shard_batch",
    "sum_repeated_kv_heads",
]
