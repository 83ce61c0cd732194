"""A replay of PyTorch's CUDA caching allocator, to see on CPU how much memory fragmentation costs.

It follows the rules of ``c10/cuda/CUDACachingAllocator.cpp`` in its default configuration (one
stream, no ``max_split_size_mb``, no expandable segments, no garbage-collection threshold):

* every request is rounded up to a multiple of 512 bytes (at least 512);
* rounded requests of at most 1 MiB use the *small* pool, larger ones the *large* pool;
* a request takes the smallest cached free block of its pool that fits (lowest address on ties);
* when none fits, a new segment is allocated from the device (``cudaMalloc``): 2 MiB for small
  requests, 20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB;
* the block is split when the rest is worth keeping: at least 512 bytes in the small pool, more
  than 1 MiB in the large pool; the rest stays cached as a free block;
* a freed block merges with its free neighbours of the same segment and stays cached (reserved);
* with a device ``capacity``, a segment that does not fit makes the allocator free every cached
  segment that is entirely free and retry once (``num_alloc_retries``); failing again is out of memory.

*Reserved* bytes are the segments held from the device, *allocated* the blocks in use, *requested*
the bytes the program asked for.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from hf_memo.planner.lifetimes import Lifetime, Trace

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20  # largest request of the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
MIN_LARGE_ALLOC = 10 << 20  # requests from here on get a segment of their own size
ROUND_LARGE = 2 << 20


def round_request(size: int) -> int:
    """The block size a request of ``size`` bytes gets: a multiple of 512, at least 512."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_size(rounded: int) -> int:
    """Bytes of the new device segment made for a rounded request that fits no cached block."""
    if rounded <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    small: bool
    allocated: bool = False
    requested: int = 0
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


@dataclass
class AllocatorReplay:
    """Memory of the caching allocator along a trace (lists have one entry per event, after it)."""

    requested: list[int]
    allocated: list[int]
    reserved: list[int]
    segment_allocations: int
    segment_releases: int
    alloc_retries: int
    out_of_memory_at: int | None = None

    @property
    def peak_requested(self) -> int:
        return max(self.requested, default=0)

    @property
    def peak_reserved(self) -> int:
        return max(self.reserved, default=0)

    @property
    def peak_allocated(self) -> int:
        return max(self.allocated, default=0)

    @property
    def reserved_over_requested(self) -> float:
        """Peak reserved / peak requested: the fragmentation and rounding overhead (1.0 = none)."""
        return self.peak_reserved / self.peak_requested if self.peak_requested else 1.0

    def summary(self) -> dict[str, Any]:
        """Peaks and counters, JSON-serialisable."""
        return {
            "peak_requested": self.peak_requested,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "reserved_over_requested": round(self.reserved_over_requested, 4),
            "segment_allocations": self.segment_allocations,
            "segment_releases": self.segment_releases,
            "alloc_retries": self.alloc_retries,
            "out_of_memory_at": self.out_of_memory_at,
        }


@dataclass
class CachingAllocator:
    """The allocator's state; :meth:`malloc` and :meth:`free` follow the module docstring's rules."""

    capacity: int | None = None
    reserved: int = 0
    allocated: int = 0
    requested: int = 0
    segment_allocations: int = 0
    segment_releases: int = 0
    alloc_retries: int = 0
    _pools: dict[bool, list[tuple[int, int]]] = field(default_factory=lambda: {True: [], False: []})
    _free: dict[tuple[int, int], _Block] = field(default_factory=dict)
    _live: dict[int, _Block] = field(default_factory=dict)
    _next_address: int = 0

    def _cache(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], block.key)
        self._free[block.key] = block

    def _uncache(self, block: _Block) -> None:
        pool = self._pools[block.small]
        del pool[bisect.bisect_left(pool, block.key)]
        del self._free[block.key]

    def _new_segment(self, size: int, small: bool) -> _Block | None:
        if self.capacity is not None and self.reserved + size > self.capacity:
            for key in [key for key, block in self._free.items() if block.prev is None and block.next is None]:
                block = self._free[key]
                self._uncache(block)
                self.reserved -= block.size
                self.segment_releases += 1
            self.alloc_retries += 1
            if self.reserved + size > self.capacity:
                return None
        block = _Block(self._next_address, size, small)
        self._next_address += size
        self.reserved += size
        self.segment_allocations += 1
        return block

    def malloc(self, tensor_id: int, size: int) -> bool:
        """Serve a request; ``False`` when the device is out of memory."""
        rounded = round_request(size)
        small = rounded <= SMALL_REQUEST
        pool = self._pools[small]
        index = bisect.bisect_left(pool, (rounded, -1))
        if index < len(pool):
            block = self._free[pool[index]]
            self._uncache(block)
        else:
            block = self._new_segment(segment_size(rounded), small)
            if block is None:
                return False
        rest = block.size - rounded
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            remainder = _Block(block.address + rounded, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = remainder
            block.next, block.size = remainder, rounded
            self._cache(remainder)
        block.allocated, block.requested = True, size
        self._live[tensor_id] = block
        self.allocated += block.size
        self.requested += size
        return True

    def free(self, tensor_id: int) -> None:
        """Return a tensor's block to the cache, merged with its free neighbours."""
        block = self._live.pop(tensor_id)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._uncache(neighbour)
                if neighbour is block.prev:
                    block.address, block.prev = neighbour.address, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += neighbour.size
        self._cache(block)


def replay(trace: Trace, capacity: int | None = None) -> AllocatorReplay:
    """Run ``trace``'s requests through a fresh :class:`CachingAllocator` (``capacity``: device bytes)."""
    allocator = CachingAllocator(capacity)
    requested, allocated, reserved = [], [], []
    out_of_memory_at = None
    for index, (op, tensor_id, size) in enumerate(trace.events()):
        if op == "free":
            allocator.free(tensor_id)
        elif not allocator.malloc(tensor_id, size):
            out_of_memory_at = index
            break
        requested.append(allocator.requested)
        allocated.append(allocator.allocated)
        reserved.append(allocator.reserved)
    return AllocatorReplay(
        requested,
        allocated,
        reserved,
        allocator.segment_allocations,
        allocator.segment_releases,
        allocator.alloc_retries,
        out_of_memory_at,
    )


def replay_with_arena(trace: Trace, arena_size: int) -> AllocatorReplay:
    """Replay ``trace`` as the runtime runs it with a plan: its named tensors (the buffers hf_memo owns)
    are views of one arena of ``arena_size`` bytes, allocated before everything else and never freed;
    every other tensor goes through the caching allocator as before."""
    lives = [life for life in trace.lifetimes if life.tensor_id not in trace.names]
    if arena_size > 0 and trace.length > 0:
        arena_id = min((life.tensor_id for life in trace.lifetimes), default=0) - 1  # first of the mallocs at 0
        lives.append(Lifetime(arena_id, arena_size, 0, trace.length))
    return replay(Trace(lives, trace.length))
