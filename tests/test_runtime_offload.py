import gc

import pytest
import torch

from hf_memo.profiler.placement import location_of
from hf_memo.runtime.offload import (
    HOST_REGISTER_PORTABLE,
    PAGE,
    CopyEngine,
    HostMemoryUnavailable,
    HostPool,
    RegisteredMemory,
)


def test_pool_reuses_released_buffers_and_does_not_grow():
    pool = HostPool(torch.device("cpu"))
    for _ in range(3):
        a, b = pool.acquire(1000), pool.acquire(4000)
        pool.release(a)
        pool.release(b)
    assert pool.reserved_bytes == 5000 and pool.in_use_bytes == 0
    small = pool.acquire(900)
    assert small.numel() == 1000  # the smallest free buffer that fits
    assert location_of(small.untyped_storage()) == "host"


def test_pool_picks_among_several_free_buffers_by_size():
    pool = HostPool(torch.device("cpu"))
    buffers = [pool.acquire(n) for n in (3000, 1000, 2000)]
    for buffer in buffers:
        pool.release(buffer)
    assert pool.acquire(1500).numel() == 2000 and pool.acquire(10).numel() == 1000
    assert pool.acquire(2500).numel() == 3000 and pool.reserved_bytes == 6000


def test_cpu_copies_are_plain_and_events_are_none():
    engine = CopyEngine(torch.device("cpu"))
    src, dst = torch.arange(10.0), torch.empty(10)
    assert engine.to_host(dst, src) is None and torch.equal(dst, src)
    back = torch.empty(10)
    assert engine.to_device(back, dst) is None and torch.equal(back, src)
    assert engine.mark() is None
    engine.wait(None)


class FakeCudaRuntime:
    """Stands in for ``torch.cuda.cudart()``: pins whole pages, as the driver does, and counts them."""

    class cudaError:  # noqa: N801 (the binding's name)
        success = 0

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}  # address -> bytes

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802
        assert address % PAGE == 0 and flags == HOST_REGISTER_PORTABLE and address not in self.pinned
        self.pinned[address] = -(-nbytes // PAGE) * PAGE
        return self.cudaError.success

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        del self.pinned[address]
        return self.cudaError.success

    def cudaGetErrorString(self, error: int) -> str:  # noqa: N802
        return "out of memory"


def _pinning_pool() -> tuple[HostPool, FakeCudaRuntime]:
    cudart = FakeCudaRuntime()
    return HostPool(torch.device("cpu"), RegisteredMemory(cudart)), cudart


def test_pinned_bytes_are_the_requested_bytes_rounded_to_pages_not_to_powers_of_two():
    pool, cudart = _pinning_pool()
    sizes = [3 * 2**20 + 5, 5 * 2**20, 123_457]  # PyTorch's pinned allocator would pin 4 + 8 + 0.125 MiB
    buffers = [pool.acquire(n) for n in sizes]
    pinned = sum(cudart.pinned.values())
    assert pool.reserved_bytes == pinned and sum(sizes) <= pinned < sum(sizes) + len(sizes) * PAGE
    for buffer, n in zip(buffers, sizes):
        assert buffer.numel() == n and not buffer.is_pinned()  # plain memory, registered (not faked here)
        start = buffer.data_ptr() - buffer.data_ptr() % PAGE
        assert start in cudart.pinned and buffer.data_ptr() == start  # each buffer starts its pinned pages
    buffers[0].copy_(torch.arange(sizes[0]).to(torch.uint8))
    assert torch.equal(buffers[0][:300], torch.arange(300).to(torch.uint8))


def test_a_step_frees_the_buffers_it_did_not_use_and_reuses_those_of_nearby_sizes():
    pool, cudart = _pinning_pool()
    MiB = 2**20
    old = [pool.acquire(2 * MiB) for _ in range(3)]  # a step of one length
    for buffer in old:
        pool.release(buffer)
    pool.end_step()
    assert pool.reserved_bytes == sum(cudart.pinned.values()) == 6 * MiB  # all used in the step: kept
    nearby = [pool.acquire(int(1.7 * MiB)) for _ in range(2)]  # a slightly shorter step reuses them, pins nothing
    assert [b.numel() for b in nearby] == [2 * MiB] * 2 and pool.reserved_bytes == 6 * MiB
    kept = pool.acquire(2 * MiB)
    for buffer in nearby:
        pool.release(buffer)
    pool.end_step()  # ``kept`` is still in use: only released buffers can go
    assert pool.reserved_bytes == 6 * MiB
    short = pool.acquire(MiB)  # much shorter: a buffer of its own, not one twice its size
    assert short.numel() == MiB and pool.reserved_bytes == 7 * MiB
    pool.release(short)
    pool.release(kept)
    del old, nearby, kept, short, buffer
    pool.end_step()  # only ``short`` was acquired in this step: the others go
    gc.collect()
    assert pool.reserved_bytes == sum(cudart.pinned.values()) == MiB


def test_a_failed_registration_names_the_host_memory_limit():
    pool, cudart = _pinning_pool()
    cudart.cudaHostRegister = lambda address, nbytes, flags: 2
    with pytest.raises(RuntimeError, match="could not pin 8192 bytes.*out of memory.*host_memory_limit"):
        pool.acquire(5000)


def test_the_pool_stays_within_its_limit_freeing_unused_buffers_first():
    pool = HostPool(torch.device("cpu"), limit=9 * PAGE)
    idle = pool.acquire(4 * PAGE)
    pool.release(idle)  # free, but held
    held = pool.acquire(5 * PAGE, capacity=6 * PAGE)  # room only without ``idle``: it is freed, capacity kept
    assert held.numel() == 6 * PAGE and pool.reserved_bytes == 6 * PAGE
    smaller = pool.acquire(3 * PAGE, capacity=5 * PAGE)  # capacity does not fit: just the request
    assert smaller.numel() == 3 * PAGE and pool.reserved_bytes == 9 * PAGE
    with pytest.raises(HostMemoryUnavailable, match=f"{2 * PAGE} more bytes would pass the host limit of {9 * PAGE}"):
        pool.acquire(2 * PAGE)


def test_a_failed_registration_is_host_memory_unavailable():
    cudart = FakeCudaRuntime()
    cudart.cudaHostRegister = lambda address, nbytes, flags: 2
    with pytest.raises(HostMemoryUnavailable, match="cudaHostRegister could not pin"):
        HostPool(torch.device("cpu"), RegisteredMemory(cudart)).acquire(PAGE)
