"""Sequence parallelism (DeepSpeed-Ulysses): process groups, head/sequence all-to-all, sharding, loss.

The public names are imported on first use (PEP 562): the head split alone needs no model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_memo.lazy_names import lazy_names

if TYPE_CHECKING:
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

_PUBLIC = {  # name -> the module it comes from
    "SequenceParallelLM": "hf_memo.parallel.causal_lm",
    "SequenceParallelGroups": "hf_memo.parallel.groups",
    "sequence_parallel_groups": "hf_memo.parallel.groups",
    "HeadSplit": "hf_memo.parallel.heads",
    "check_head_counts": "hf_memo.parallel.heads",
    "SequenceShard": "hf_memo.parallel.sharding",
    "shard_batch": "hf_memo.parallel.sharding",
    "gather_heads_scatter_sequence": "hf_memo.parallel.ulysses",
    "repeat_kv_heads": "hf_memo.parallel.ulysses",
    "scatter_heads_gather_sequence": "hf_memo.parallel.ulysses",
    "sum_repeated_kv_heads": "hf_memo.parallel.ulysses",
}

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


__getattr__ = lazy_names(__name__, _PUBLIC)
