"""Moving bytes between device and host: a reusable host buffer pool and a copy engine with side streams.

On CUDA, host buffers are pinned and copies run on their own device-to-host and host-to-device
streams, ordered against the compute stream with events. On CPU the same calls are plain copies and
events are ``None``, so every code path runs in the CPU test suite.

Pinning: PyTorch's pinned allocator (``pin_memory=True``) rounds every request up to a power of two
and keeps freed blocks cached, so a 2.02 GiB stash would pin 4 GiB, for good. The pool instead pins
plain host memory with ``cudaHostRegister`` (:class:`RegisteredMemory`): each buffer pins its size
rounded up to a page, and unpinning gives it back to the system.
"""

from __future__ import annotations

import mmap
import os
import warnings
import weakref
from typing import Any, Protocol

import torch

from hf_memo.profiler.placement import mark_host

PAGE = mmap.PAGESIZE


class HostMemoryUnavailable(RuntimeError):
    """The host pool cannot give a buffer: pinning or allocating it failed, or it would pass the host limit."""


class HostMemoryWarning(UserWarning):
    """Offloading kept a stash on the device because the host had no room for it."""


HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class HostMemory(Protocol):
    """Where a :class:`HostPool` gets its buffers."""

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """A ``(nbytes,)`` uint8 host buffer and the bytes it really holds; freed when the buffer is garbage."""
        ...


class PlainMemory:
    """Unpinned host memory (CPU runs: copies are plain copies)."""

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, int]:
        return torch.empty(nbytes, dtype=torch.uint8), nbytes


class RegisteredMemory:
    """Page-aligned plain host memory pinned with ``cudaHostRegister``: exactly its pages are pinned.

    Args:
        cudart: the CUDA runtime bindings (``torch.cuda.cudart()`` by default); the tests pass a stand-in.
        device: the device whose streams copy from and to the buffers (synchronised before unpinning).
    """

    def __init__(self, cudart: Any = None, device: torch.device | None = None) -> None:
        self.cudart = cudart if cudart is not None else torch.cuda.cudart()
        self.device = device

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, int]:
        pinned = -(-max(nbytes, 1) // PAGE) * PAGE
        raw = torch.empty(pinned + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        buffer = raw[start : start + nbytes]
        # Portable: pinned for every device's context, not only the current device's (several GPUs per process
        # or a current device other than the model's)
        error = self.cudart.cudaHostRegister(raw.data_ptr() + start, pinned, HOST_REGISTER_PORTABLE)
        if error != self.cudart.cudaError.success:
            raise HostMemoryUnavailable(
                f"cudaHostRegister could not pin {pinned} bytes of host memory for offloading "
                f"({self.cudart.cudaGetErrorString(error)}); lower MemoConfig.host_memory_limit"
            )
        # Unpinned once the buffer is garbage; ``raw`` (held by the finaliser) keeps the memory until then.
        weakref.finalize(buffer, self._unregister, raw, raw.data_ptr() + start).atexit = False
        return buffer, pinned

    def _unregister(self, raw: torch.Tensor, address: int) -> None:
        if self.device is not None:
            torch.cuda.synchronize(self.device)  # no copy may still read or write the pages
        self.cudart.cudaHostUnregister(address)


REUSE_SLACK = 1.25  # a free buffer serves requests down to 1 / REUSE_SLACK of its size (or one page less)


class HostPool:
    """Host byte buffers reused across steps: acquiring after a release of a buffer that fits allocates nothing.

    Buffers are pinned (:class:`RegisteredMemory`) when the device is CUDA. A free buffer serves a request
    at most ``REUSE_SLACK`` times smaller than itself (steps of nearby lengths, as variable-length batches
    have, reuse their buffers instead of pinning new ones; a much shorter step does not sit on a long
    one's). :meth:`end_step` frees the free buffers no request used during the step. ``reserved_bytes``
    counts the bytes the buffers really hold (pinned bytes on CUDA).

    Args:
        memory: where buffers come from; by default pinned memory for CUDA, plain memory otherwise.
        limit: the bytes the pool may hold (``MemoConfig.host_memory_limit``); ``None``: no limit.
        copies: the copy engine, asked whether a buffer given back or taken again still has a copy pending.
    """

    def __init__(
        self, device: torch.device, memory: HostMemory | None = None, limit: int | None = None, copies: Any = None
    ) -> None:
        if memory is None:
            memory = RegisteredMemory(device=device) if device.type == "cuda" else PlainMemory()
        self.memory, self.limit, self.copies = memory, limit, copies
        self._free: list[torch.Tensor] = []
        self._held: dict[int, int] = {}  # id(buffer) -> bytes held
        self._used: set[int] = set()  # ids of the buffers acquired since the last end_step
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self._warned = False

    def acquire(self, nbytes: int, capacity: int = 0) -> torch.Tensor:
        """A ``(>= nbytes,)`` uint8 host buffer: the smallest free one that fits without wasting more than
        ``REUSE_SLACK``, else a new one of ``max(nbytes, capacity)`` bytes (``capacity``: what the longest step
        of the length bucket will ask for, so that its steps share the buffer)."""
        largest = max(REUSE_SLACK * nbytes, nbytes + PAGE)
        fitting = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= largest]
        if fitting:
            buffer = self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
            if self.copies is not None:
                self.copies.check_unused(buffer, "taken again from the host pool")
        else:
            buffer, held = self._allocate(nbytes, max(nbytes, capacity))
            mark_host(buffer)
            self._held[id(buffer)] = held
            self.reserved_bytes += held
        self._used.add(id(buffer))
        self.in_use_bytes += buffer.numel()
        return buffer

    def warn_once(self, message: str) -> None:
        """One :class:`HostMemoryWarning` per pool: the first stash the host cannot take says so."""
        if not self._warned:
            self._warned = True
            warnings.warn(message, HostMemoryWarning, stacklevel=3)

    def _allocate(self, nbytes: int, size: int) -> tuple[torch.Tensor, int]:
        """A new buffer of ``size`` bytes (``nbytes`` if ``size`` does not fit the limit), freeing the free buffers
        first if the limit needs their room.

        Raises:
            HostMemoryUnavailable: even ``nbytes`` passes the limit, or the host memory could not be had.
        """
        if self.limit is not None and self.reserved_bytes + size > self.limit:
            self._free_unused(keep=())
            size = size if self.reserved_bytes + size <= self.limit else nbytes
            if self.reserved_bytes + nbytes > self.limit:
                raise HostMemoryUnavailable(
                    f"{nbytes} more bytes would pass the host limit of {self.limit} bytes ({self.reserved_bytes} held)"
                )
        try:
            return self.memory.allocate(size)
        except HostMemoryUnavailable:
            raise
        except (RuntimeError, MemoryError) as error:  # e.g. "DefaultCPUAllocator: can't allocate memory"
            raise HostMemoryUnavailable(f"{size} bytes of host memory could not be allocated ({error})") from None

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer from :meth:`acquire` back for reuse."""
        if self.copies is not None:
            self.copies.check_unused(buffer, "given back to the host pool")
        self.in_use_bytes -= buffer.numel()
        self._free.append(buffer)

    def end_step(self) -> None:
        """A training step ended: free the free buffers that no request used during it."""
        self._free_unused(keep=self._used)
        self._used = set()

    def _free_unused(self, keep: set[int] | tuple) -> None:
        """Free the free buffers whose ids are not in ``keep``."""
        kept = []
        for buffer in self._free:
            if id(buffer) in keep:
                kept.append(buffer)
            else:
                self.reserved_bytes -= self._held.pop(id(buffer))
        self._free = kept


class CopyEngine:
    """Asynchronous device<->host copies on side streams (CUDA), or plain copies (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None

    def _copy(
        self, stream: torch.cuda.Stream | None, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        if stream is None:
            dst.copy_(src)
            return None
        stream.wait_event(torch.cuda.current_stream(self.device).record_event())
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            return stream.record_event()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Copy device ``src`` into host ``dst`` once the compute stream's work so far is done. The caller keeps
        ``src`` until the compute stream has waited on the returned event: its memory is not marked on the copy
        stream (``record_stream``), which would keep it past its last reference where no profile sees it."""
        return self._copy(self.d2h, dst, src, None)

    def to_device(
        self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """Copy host ``src`` into device ``dst`` once the compute stream's work so far and ``after`` (e.g. the
        copy that filled ``src``) are done."""
        return self._copy(self.h2d, dst, src, after)

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for ``event`` (no-op on CPU)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def mark(self) -> torch.cuda.Event | None:
        """An event at the compute stream's current position (``None`` on CPU)."""
        return torch.cuda.current_stream(self.device).record_event() if self.cuda else None

    def check_unused(self, buffer: torch.Tensor, action: str) -> None:
        """Whether a pending copy uses ``buffer``: not known to the streams (the deferred engine checks it)."""


COPY_ENGINE_ENV = "HF_MEMO_COPY_ENGINE"
"""``deferred``: CPU runs copy through :class:`~hf_memo.runtime.deferred_copies.DeferredCopies` (tests)."""


def copy_engine(device: torch.device) -> Any:
    """The copy engine of ``device``: :class:`CopyEngine`, or on the CPU with ``HF_MEMO_COPY_ENGINE=deferred`` the
    stand-in for CUDA's streams that carries copies out late (:mod:`hf_memo.runtime.deferred_copies`)."""
    choice = os.environ.get(COPY_ENGINE_ENV, "")
    if choice not in ("", "deferred"):
        raise ValueError(f"{COPY_ENGINE_ENV}={choice!r}: expected 'deferred' or nothing")
    if choice == "deferred" and device.type == "cpu":
        from hf_memo.runtime.deferred_copies import DeferredCopies

        return DeferredCopies(device)
    return CopyEngine(device)
