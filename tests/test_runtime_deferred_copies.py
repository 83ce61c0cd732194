"""The deferred copy engine (hf_memo/runtime/deferred_copies.py): CUDA's late copies, shown on the CPU."""

import gc

import pytest
import torch

from hf_memo.profiler.placement import mark_host
from hf_memo.runtime import deferred_copies
from hf_memo.runtime.deferred_copies import DeferredCopies, PendingCopyError
from hf_memo.runtime.offload import COPY_ENGINE_ENV, CopyEngine, HostPool, copy_engine

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_faults_left():
    deferred_copies.faults()
    yield
    deferred_copies.faults()


def _host(n: int) -> torch.Tensor:
    return mark_host(torch.zeros(n))


def test_a_copy_is_carried_out_only_when_its_event_or_a_later_one_is_waited_on():
    engine = DeferredCopies(CPU)
    src, twice, first, second = torch.arange(4.0), torch.arange(4.0) * 2, _host(4), _host(4)
    one = engine.to_host(first, src)
    two = engine.to_host(second, twice)  # the sources are the caller's to keep until the copies are done
    assert torch.isnan(first).all() and torch.isnan(second).all()  # 0xFF bytes until then
    engine.wait(two)  # stream order: the first copy too
    assert torch.equal(first, src) and torch.equal(second, src * 2) and engine.carried_out == 2
    engine.wait(one)  # done already: nothing again
    assert engine.carried_out == 2


def test_a_host_to_device_copy_after_a_device_to_host_one_carries_that_out_first():
    engine = DeferredCopies(CPU)
    host, back, src = _host(3), torch.empty(3), torch.tensor([1.0, 2.0, 3.0])
    stored = engine.to_host(host, src)
    fetched = engine.to_device(back, host, stored)
    engine.wait(fetched)
    assert torch.equal(back, torch.tensor([1.0, 2.0, 3.0]))
    assert engine.mark().stream is None  # the compute stream: synchronous on the CPU


def test_a_source_written_before_its_copy_is_carried_out_fails():
    engine = DeferredCopies(CPU)
    src = torch.ones(5)
    event = engine.to_host(_host(5), src)
    src.add_(1)  # CUDA would copy the new values
    with pytest.raises(PendingCopyError, match="source of a .* changed"):
        engine.wait(event)


def test_a_device_destination_freed_with_its_copy_pending_fails_at_the_next_copy():
    engine = DeferredCopies(CPU)
    engine.to_device(torch.empty(4), _host(4))  # the destination dies at once
    gc.collect()
    with pytest.raises(PendingCopyError, match="destination of a .* was freed before the copy"):
        engine.to_device(torch.empty(4), _host(4))


def test_a_device_to_host_source_freed_with_its_copy_pending_fails_at_the_next_copy():
    """The engine does not hold a device-to-host copy's source (CUDA's does not either): its user must keep it until
    the copy is waited on, or the copy would read memory handed to someone else."""
    engine = DeferredCopies(CPU)
    host, kept = _host(4), torch.ones(4)
    engine.wait(engine.to_host(host, kept))  # kept until the copy is done: fine
    engine.to_host(host, torch.ones(4))  # the source dies at once
    gc.collect()
    with pytest.raises(PendingCopyError, match="source of a .* device-to-host copy was freed before the copy"):
        engine.to_host(host, kept)


def test_a_host_buffer_given_back_or_taken_again_with_a_copy_pending_fails():
    engine = DeferredCopies(CPU)
    pool = HostPool(CPU, copies=engine)
    buffer = pool.acquire(64)
    ones = torch.ones(16)
    event = engine.to_host(buffer.view(torch.float32), ones)
    with pytest.raises(PendingCopyError, match="given back to the host pool"):
        pool.release(buffer)
    assert deferred_copies.faults()  # recorded too: a finalizer that gives a buffer back swallows the error
    engine.wait(event)
    pool.release(buffer)
    engine.to_device(torch.empty(16), buffer.view(torch.float32))  # a stale user of the buffer given back
    with pytest.raises(PendingCopyError, match="taken again from the host pool"):
        pool.acquire(64)


def test_a_device_to_host_copy_from_host_memory_is_rejected():
    with pytest.raises(PendingCopyError, match="a stash must not offload tensors that are not on its device"):
        DeferredCopies(CPU).to_host(_host(2), _host(2))


def test_the_environment_variable_chooses_the_engine(monkeypatch):
    assert type(copy_engine(CPU)) is CopyEngine
    monkeypatch.setenv(COPY_ENGINE_ENV, "deferred")
    assert isinstance(copy_engine(CPU), DeferredCopies)
    monkeypatch.setenv(COPY_ENGINE_ENV, "later")
    with pytest.raises(ValueError, match="expected 'deferred'"):
        copy_engine(CPU)
