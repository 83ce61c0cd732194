import torch

from hf_memo.profiler.placement import location_of
from hf_memo.runtime.offload import CopyEngine, HostPool


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
