import random

import pytest
import torch
from hypothesis import given, settings

from hf_memo.planner.caching_allocator import (
    CachingAllocator,
    replay,
    replay_with_arena,
    round_request,
    segment_size,
)
from hf_memo.planner.lifetimes import Trace
from tests.planner_traces import traces

MiB = 1 << 20


def test_rounding_and_segment_sizes_follow_the_cuda_allocator():
    assert [round_request(n) for n in (1, 512, 513, 1000, 1536)] == [512, 512, 1024, 1024, 1536]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # small pool
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # 1-10 MiB: 20 MiB segments
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1024) == 12 * MiB  # own size, 2 MiB steps


def test_small_requests_share_a_two_mib_segment_and_are_split_to_512_bytes():
    result = replay(Trace.from_events([("malloc", 1, 100), ("malloc", 2, 700), ("malloc", 3, 4096)]))
    assert result.reserved == [2 * MiB] * 3
    assert result.allocated == [512, 512 + 1024, 512 + 1024 + 4096]
    assert result.requested[-1] == 100 + 700 + 4096
    assert result.segment_allocations == 1


def test_mid_sized_requests_split_a_twenty_mib_segment_and_large_ones_get_their_own():
    events = [("malloc", 1, 5 * MiB), ("malloc", 2, 5 * MiB), ("malloc", 3, 12 * MiB)]
    result = replay(Trace.from_events(events))
    assert result.reserved == [20 * MiB, 20 * MiB, 32 * MiB]
    assert result.segment_allocations == 2


def test_large_pool_does_not_split_off_a_remainder_of_one_mib_or_less():
    allocator = CachingAllocator()
    allocator.malloc(1, 19 * MiB + 512)  # 20 MiB segment, rest 511.5 KiB: kept whole
    assert allocator.allocated == 20 * MiB


def test_freed_blocks_are_cached_and_merged_with_free_neighbours():
    events = [("malloc", 1, 5 * MiB), ("malloc", 2, 5 * MiB), ("free", 1, 5 * MiB), ("free", 2, 5 * MiB)]
    events.append(("malloc", 3, 18 * MiB))  # fits only in the merged 20 MiB block
    result = replay(Trace.from_events(events))
    assert result.reserved == [20 * MiB] * 5
    assert result.segment_allocations == 1 and result.allocated[-1] == 18 * MiB


def test_fragmentation_a_freed_block_too_small_for_the_next_request_stays_reserved():
    events = [("malloc", 1, 12 * MiB), ("malloc", 2, 12 * MiB), ("free", 1, 12 * MiB), ("malloc", 3, 14 * MiB)]
    result = replay(Trace.from_events(events))
    assert result.peak_requested == 26 * MiB and result.peak_reserved == 38 * MiB
    assert result.reserved_over_requested == pytest.approx(38 / 26)


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    allocator = CachingAllocator()
    for tensor_id, size in enumerate((16 * MiB, 12 * MiB, 14 * MiB)):
        allocator.malloc(tensor_id, size)
    allocator.free(0)
    allocator.free(2)
    allocator.malloc(9, 13 * MiB)  # the 14 MiB block, not the 16 MiB one; 1 MiB rest is not split off
    assert allocator.segment_allocations == 3 and allocator.allocated == 12 * MiB + 14 * MiB


def test_with_a_capacity_cached_segments_are_released_and_the_allocation_retried():
    events = [("malloc", 1, 20 * MiB), ("free", 1, 20 * MiB), ("malloc", 2, 30 * MiB)]
    result = replay(Trace.from_events(events), capacity=40 * MiB)
    assert (result.alloc_retries, result.segment_releases, result.peak_reserved) == (1, 1, 30 * MiB)
    assert result.out_of_memory_at is None
    out_of_memory = replay(Trace.from_events([("malloc", 1, 20 * MiB), ("malloc", 2, 20 * MiB)]), capacity=30 * MiB)
    assert out_of_memory.out_of_memory_at == 1 and out_of_memory.alloc_retries == 1


@settings(max_examples=50, deadline=None)
@given(traces(max_tensors=60, sizes=(100, 512, 4096, 600_000, 2 * MiB, 11 * MiB)))
def test_reserved_covers_allocated_covers_requested_and_everything_freed_is_unallocated(trace):
    result = replay(trace)
    for requested, allocated, reserved in zip(result.requested, result.allocated, result.reserved):
        assert requested <= allocated <= reserved
    live_at_end = sum(life.size for life in trace.lifetimes if life.end == trace.length)
    assert result.requested[-1] == live_at_end
    assert result.peak_requested == trace.lower_bound()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with the real CUDA caching allocator")
def test_replay_matches_the_real_cuda_caching_allocator():
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() != 0:
        pytest.skip("other CUDA tensors are alive in this process")
    rng = random.Random(0)
    events, live = [], []
    for tensor_id in range(400):
        while live and rng.random() < 0.45:
            events.append(("free", *live.pop(rng.randrange(len(live)))))
        size = rng.choice([100, 4096, 300_000, 900_000, 3 * MiB + 5, 7 * MiB, 11 * MiB + 3, 40 * MiB])
        events.append(("malloc", tensor_id, size))
        live.append((tensor_id, size))
    trace = Trace.from_events(events)
    tensors, reserved, allocated = {}, [], []
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats().get("num_device_alloc", 0)
    for op, tensor_id, size in trace.events():
        if op == "malloc":
            tensors[tensor_id] = torch.empty(size, dtype=torch.uint8, device="cuda")
        else:
            del tensors[tensor_id]
        reserved.append(torch.cuda.memory_reserved())
        allocated.append(torch.cuda.memory_allocated())
    segments = torch.cuda.memory_stats()["num_device_alloc"] - before
    tensors.clear()
    torch.cuda.empty_cache()
    result = replay(trace)
    assert result.allocated == allocated
    assert result.reserved == reserved
    assert result.segment_allocations == segments


def test_named_buffers_come_from_one_arena_allocated_first():
    # Two owned 12 MiB buffers, one after the other, around a plain 30 MiB tensor that outlives the first.
    events = [("malloc", 1, 12 * MiB), ("malloc", 2, 30 * MiB), ("free", 1, 12 * MiB)]
    events += [("malloc", 3, 12 * MiB), ("free", 3, 12 * MiB), ("free", 2, 30 * MiB)]
    trace = Trace.from_events(events, names={1: "rounding 0", 3: "rounding 1"})
    plain = replay(trace)
    assert (plain.peak_requested, plain.peak_reserved, plain.segment_allocations) == (42 * MiB, 42 * MiB, 2)
    served = replay_with_arena(trace, 12 * MiB)  # the plan lays both buffers over the same 12 MiB
    assert served.requested[0] == 12 * MiB  # the arena comes first and stays
    assert (served.peak_requested, served.peak_reserved, served.segment_allocations) == (42 * MiB, 42 * MiB, 2)
    assert len(served.requested) == 3  # the arena, the plain tensor's malloc and free; owned buffers never ask
    assert replay_with_arena(trace, 0).peak_requested == 30 * MiB
