"""Which heads each rank of a sequence-parallel group attends with: Ulysses at any degree up to the query heads.

A group of ``P`` ranks splits the ``h`` query heads into contiguous ranges in rank order, the first ``h % P`` ranks
taking one head more (``⌈h/P⌉`` or ``⌊h/P⌋`` each): attention's work grows with the query heads, so it is as even
as it can be, and rank 0 holds the most. With grouped-query attention (``h_kv`` KV heads of ``g = h / h_kv`` query
heads each) a rank receives exactly the KV heads its query heads use: a KV head whose group straddles two ranks
goes to both, and its gradient comes back summed. That moves the fewest bytes: never more than replicating the KV
heads to the query heads before the exchange (a rank uses at most one KV head per query head), and never an uneven
query split, which keeping whole groups on one rank would need (28 query heads in 4 groups over 8 ranks: 7 or 0).

After the exchange the ranks attend with grouped-query attention when each rank's query heads use its KV heads evenly
and no rank receives more KV heads than rank 0 (every degree that divides the query heads and divides or is a
multiple of the KV heads, and any degree without GQA); otherwise every rank repeats its KV heads to one per query
head (attention as without GQA). Either way rank 0 holds the most of every tensor: it bounds the step's memory and
time, and a profile of rank 0 is one of the busiest rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


def check_head_counts(
    size: int, num_heads: int, num_kv_heads: int, name: str = "MemoConfig.sequence_parallel_size"
) -> None:
    """Ulysses gives every rank of ``size`` at least one query head: ``size`` must not exceed ``num_heads``
    (``name``: what the user set the degree with, for the error).

    Raises:
        ValueError: naming the degree, the head count and the largest degree this model accepts.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"the model's num_attention_heads={num_heads} must be a multiple of its num_key_value_heads={num_kv_heads}"
        )
    if size > num_heads:
        raise ValueError(
            f"{name}={size} exceeds the model's num_attention_heads={num_heads} (Ulysses "
            f"gives every rank at least one query head); the largest degree for this model is {num_heads}"
        )


@dataclass(frozen=True)
class HeadSplit:
    """The heads of ``heads`` query and ``kv_heads`` KV heads each of ``size`` ranks attends with after the exchange.

    Attributes:
        heads: query heads of the model.
        kv_heads: its KV heads (``heads`` without grouped-query attention).
        size: ranks of the sequence-parallel group (at most ``heads``).
    """

    heads: int
    kv_heads: int
    size: int

    def __post_init__(self) -> None:
        check_head_counts(self.size, self.heads, self.kv_heads)

    def query(self, rank: int) -> range:
        """Query heads of ``rank``: ``⌈h/P⌉`` for the first ``h % P`` ranks, ``⌊h/P⌋`` for the others."""
        base, extra = divmod(self.heads, self.size)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))

    def kv(self, rank: int) -> range:
        """KV heads ``rank``'s query heads use (those of a group that straddles ranks go to each of them)."""
        queries, group = self.query(rank), self.heads // self.kv_heads
        return range(queries.start // group, (queries.stop - 1) // group + 1)

    @cached_property
    def queries(self) -> tuple[range, ...]:
        """:meth:`query` of every rank, in rank order."""
        return tuple(self.query(rank) for rank in range(self.size))

    @cached_property
    def kvs(self) -> tuple[range, ...]:
        """:meth:`kv` of every rank, in rank order."""
        return tuple(self.kv(rank) for rank in range(self.size))

    def queries_per_kv(self, rank: int) -> tuple[int, ...]:
        """How many of ``rank``'s query heads use each of its KV heads, in order."""
        group, queries = self.heads // self.kv_heads, self.query(rank)
        return tuple(min(queries.stop, (head + 1) * group) - max(queries.start, head * group) for head in self.kv(rank))

    @cached_property
    def grouped(self) -> bool:
        """Whether every rank attends with its KV heads as they arrive: each rank's query heads use them evenly, and
        no rank receives more of them than rank 0."""
        even = all(len(set(self.queries_per_kv(rank))) == 1 for rank in range(self.size))
        return even and max(map(len, self.kvs)) == len(self.kvs[0])

    def kv_repeats(self, rank: int) -> tuple[int, ...] | None:
        """How often ``rank`` repeats each received KV head before attention (``None``: it attends with them as they
        are); the repeats make one KV head per query head."""
        return None if self.grouped else self.queries_per_kv(rank)

    def attended_kv_heads(self, rank: int) -> int:
        """KV heads ``rank`` attends with: those it receives, or one per query head where they are repeated."""
        return len(self.kv(rank)) if self.grouped else len(self.query(rank))

    @property
    def most_query_heads(self) -> int:
        """``⌈h/P⌉``: rank 0's query heads, the most any rank attends with."""
        return math.ceil(self.heads / self.size)

    @property
    def imbalance(self) -> float:
        """``⌈h/P⌉ / (h/P)``: attention's time on rank 0 over an even split's (1 where ``P`` divides ``h``)."""
        return self.most_query_heads * self.size / self.heads
