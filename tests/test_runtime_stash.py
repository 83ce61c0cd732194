import pytest
import torch

from hf_memo.runtime.offload import CopyEngine, HostPool
from hf_memo.runtime.stash import ALIGN, DeviceSlots, LayerStash


def _stash(index=0, swapped=True):
    device = torch.device("cpu")
    engine = CopyEngine(device)
    pool = HostPool(device)
    return LayerStash(
        index, swapped, engine, pool, DeviceSlots("rounding", device, engine), DeviceSlots("prefetch", device, engine)
    ), pool


@pytest.mark.parametrize("swapped", [False, True])
def test_round_trip_rebuilds_views_with_their_shapes_and_strides(swapped):
    stash, pool = _stash(swapped=swapped)
    base = torch.randn(6, 10, dtype=torch.float64)
    other = torch.arange(7, dtype=torch.int32)
    views = [base, base[:, 2:5], base.t(), other[1:]]
    refs = [stash.add(v) for v in views]
    expected = [(v.clone(), v.stride()) for v in views]
    stash.seal()
    assert stash.nbytes == 2 * ALIGN  # two storages, each rounded up to the alignment
    if swapped:
        base.zero_()  # the device copy is no longer used
        assert pool.in_use_bytes == stash.nbytes
    for ref, (want, stride) in zip(refs, expected):
        got = stash.rebuild(ref)
        assert got.shape == want.shape and got.stride() == stride and torch.equal(got, want)
    stash.release()
    assert pool.in_use_bytes == 0


def test_each_storage_is_kept_once():
    stash, _ = _stash()
    x = torch.randn(4, 8)
    for rows in range(4):
        stash.add(x[rows])
    assert stash.raw_nbytes == x.numel() * 4


def test_layers_alternate_rounding_buffers():
    device = torch.device("cpu")
    engine = CopyEngine(device)
    rounding, prefetch = DeviceSlots("rounding", device, engine), DeviceSlots("prefetch", device, engine)
    pool = HostPool(device)
    for index in range(4):
        stash = LayerStash(index, True, engine, pool, rounding, prefetch)
        stash.add(torch.randn(100))
        stash.seal()
        stash.prefetch()
        stash.release()
    assert rounding.reserved_bytes == 2 * ALIGN and prefetch.reserved_bytes == 2 * ALIGN
    assert pool.reserved_bytes == ALIGN


def test_a_stash_dropped_without_backward_gives_its_host_buffer_back():
    import gc

    stash, pool = _stash()
    stash.add(torch.randn(300))
    stash.seal()
    assert pool.in_use_bytes == ALIGN * 3
    del stash
    gc.collect()
    assert pool.in_use_bytes == 0 and pool.reserved_bytes == ALIGN * 3
