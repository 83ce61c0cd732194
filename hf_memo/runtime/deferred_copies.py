"""A CPU stand-in for the CUDA copy streams that carries copies out late, so that CPU tests see a missing wait.

On CUDA a device->host or host->device copy runs on a stream of its own and ends whenever it ends: code that reads
a destination before waiting on the copy's event, frees a destination, or hands a host buffer on while a copy is
pending reads or writes memory it does not own. On the CPU, :class:`~hf_memo.runtime.offload.CopyEngine` copies at
once and none of that shows. :class:`DeferredCopies` (``HF_MEMO_COPY_ENGINE=deferred``) makes it show:

- each copy is queued on its stream and carried out only when its event, or a later one of the same stream, is
  waited on (or a copy that must follow it is carried out), in stream order;
- until then its destination holds 0xFF bytes (NaN in floating point), so reading it early is reading garbage;
- a device->host copy's source is snapshotted when the copy is issued and compared when it is carried out: a source
  written meanwhile would be copied with its new bytes on CUDA;
- a destination or a device->host copy's source freed, or a host buffer given back to or taken again from the pool,
  with a copy pending raises :class:`PendingCopyError` (at the engine's next call for a freed one): CUDA would write
  memory with a new owner, or copy it (the engine holds no device source, as CUDA's does not: its user keeps it until
  the copy's event is waited on);
- a device->host copy whose source is host memory raises: a stash must offload only tensors on its device.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_memo.profiler.placement import location_of


class PendingCopyError(RuntimeError):
    """Memory with a pending copy was read, freed or handed on (see the module docstring)."""


@dataclass(eq=False)
class _Stream:
    """One copy stream: the copies issued on it, those not yet carried out first in line."""

    name: str
    pending: deque = field(default_factory=deque)
    issued: int = 0
    done: int = 0


@dataclass(eq=False)
class DeferredEvent:
    """The point of ``stream`` after its first ``position`` copies (``stream`` ``None``: the compute stream, which
    runs synchronously on the CPU, so the event has happened)."""

    stream: _Stream | None
    position: int = 0


@dataclass(eq=False)
class _Copy:
    """A queued copy: its destination by storage (held weakly, so that freeing it shows) and view, its source (a host
    one held; a device one held weakly, as CUDA holds none), a device->host source's bytes when issued, and the event
    it waits for."""

    destination: _Weak
    source: _Weak | torch.Tensor
    snapshot: torch.Tensor | None
    after: DeferredEvent | None
    watches: tuple[weakref.finalize, ...]
    what: str

    def source_tensor(self) -> torch.Tensor | None:
        """The source, or ``None`` if it was freed."""
        return self.source if isinstance(self.source, torch.Tensor) else self.source.tensor()

    def uses(self, storage: torch.UntypedStorage) -> bool:
        """Whether the copy reads or writes ``storage``."""
        source = self.source.untyped_storage() if isinstance(self.source, torch.Tensor) else self.source.storage()
        return storage is self.destination.storage() or storage is source


@dataclass(eq=False)
class _Weak:
    """A view of a storage held weakly: freeing the storage shows (:meth:`watch`), and the view is made again while
    it lives."""

    storage: weakref.ref
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Weak:
        return cls(
            weakref.ref(tensor.untyped_storage()),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )

    def tensor(self) -> torch.Tensor | None:
        """The view, or ``None`` once its storage is freed."""
        storage = self.storage()
        if storage is None:
            return None
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.offset, self.shape, self.stride
        )

    def watch(self, fault: str) -> weakref.finalize:
        """Record ``fault`` if the storage is freed before the returned finalizer is detached (device memory only:
        host buffers are unpinned only after a device synchronisation, see ``RegisteredMemory``)."""
        storage = self.storage()
        watch = weakref.finalize(storage, _RECORDED.append, fault)
        if location_of(storage) == "host":
            watch.detach()
        return watch


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as bytes ``(numel * itemsize,)`` uint8 (so NaNs compare equal to themselves)."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _fill_ff(tensor: torch.Tensor) -> None:
    """Every byte of ``tensor``'s elements 0xFF (NaN for floating point, -1 for signed integers)."""
    if tensor.numel():
        ones = torch.full((tensor.element_size(),), 0xFF, dtype=torch.uint8, device=tensor.device)
        tensor.copy_(ones.view(tensor.dtype).reshape(()).expand_as(tensor))


# Faults found where nothing can raise (a destination freed, seen by its storage's finalizer), until reported.
_RECORDED: list[str] = []


def faults() -> list[str]:
    """The faults recorded and not raised yet (then cleared): a test's teardown asks, since a destination freed at
    the end of a step would show only at the next copy of a deferred engine."""
    found = list(_RECORDED)
    _RECORDED.clear()
    return found


class DeferredCopies:
    """The :class:`~hf_memo.runtime.offload.CopyEngine` interface with copies carried out late (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = False
        self.d2h, self.h2d = _Stream("device-to-host"), _Stream("host-to-device")
        self.carried_out = 0  # copies done so far (tests count them)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> DeferredEvent:
        """Queue copying device ``src`` into host ``dst``; ``src`` is not held (its bytes are kept, to compare): the
        caller keeps it until the copy's event is waited on, else the copy faults."""
        self._raise_faults()
        if location_of(src.untyped_storage()) == "host":
            raise PendingCopyError(
                "a device-to-host copy from host memory (a stash must not offload tensors that are not on its device)"
            )
        return self._queue(self.d2h, dst, src, None if is_fake(src) else _bytes(src).clone(), None)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: DeferredEvent | None = None) -> DeferredEvent:
        """Queue copying host ``src`` into device ``dst`` after ``after`` (e.g. the copy that filled ``src``)."""
        self._raise_faults()
        return self._queue(self.h2d, dst, src, None, after)

    def wait(self, event: DeferredEvent | None) -> None:
        """Carry out the copies of ``event``'s stream up to it (and what they wait for). Raises nothing recorded
        earlier (it may run in a finalizer): the next copy issued, or :func:`faults`, reports it."""
        if event is not None:
            self._carry_out(event)

    def mark(self) -> DeferredEvent:
        """An event at the compute stream's current position: already reached on the CPU."""
        self._raise_faults()
        return DeferredEvent(None)

    def synchronize(self) -> None:
        """Carry out every copy issued so far (what ``torch.cuda.synchronize`` waits for)."""
        for stream in (self.d2h, self.h2d):
            self._carry_out(DeferredEvent(stream, stream.issued))
        self._raise_faults()

    def check_unused(self, buffer: torch.Tensor, action: str) -> None:
        """Raise if a pending copy reads or writes ``buffer``'s storage, which the pool is about to ``action``."""
        storage = buffer.untyped_storage()
        for stream in (self.d2h, self.h2d):
            for copy in stream.pending:
                if copy.uses(storage):
                    message = (
                        f"a host buffer is {action} while a {copy.what} copy of the {stream.name} stream still uses "
                        "it: on CUDA its next owner's data would be overwritten or copied"
                    )
                    _RECORDED.append(message)  # also for a teardown's check: a finalizer swallows what it raises
                    raise PendingCopyError(message)

    def _queue(
        self,
        stream: _Stream,
        dst: torch.Tensor,
        src: torch.Tensor,
        snapshot: torch.Tensor | None,
        after: DeferredEvent | None,
    ) -> DeferredEvent:
        if is_fake(dst) or is_fake(src):  # a profile on fake tensors (no values to defer): copied as issued
            dst.copy_(src)
            return DeferredEvent(None)
        stream.issued += 1
        what = f"{tuple(src.shape)} {src.dtype}"
        # Device memory freed with a copy pending is handed out again at once (host memory is not watched)
        destination = _Weak.of(dst)
        watches = [
            destination.watch(
                f"the destination of a {what} copy of the {stream.name} stream was freed before the copy was carried "
                "out: on CUDA the copy would write memory handed to someone else"
            )
        ]
        source = src
        if stream is self.d2h:  # CUDA holds no device source: its memory could be reused while the copy reads it
            source = _Weak.of(src)
            watches.append(
                source.watch(
                    f"the source of a {what} device-to-host copy was freed before the copy was carried out: on CUDA "
                    "its memory could be handed to someone else while the copy reads it (a missing reference)"
                )
            )
        stream.pending.append(_Copy(destination, source, snapshot, after, tuple(watches), what))
        _fill_ff(dst)
        return DeferredEvent(stream, stream.issued)

    def _carry_out(self, event: DeferredEvent) -> None:
        stream = event.stream
        while stream is not None and stream.done < event.position:
            copy = stream.pending.popleft()
            stream.done += 1
            if copy.after is not None:
                self._carry_out(copy.after)
            for watch in copy.watches:
                watch.detach()
            source = copy.source_tensor()
            if source is None:
                continue  # freed: its watch reported it
            if copy.snapshot is not None and not torch.equal(_bytes(source), copy.snapshot):
                raise PendingCopyError(
                    f"the source of a {copy.what} device-to-host copy changed between the copy's issue and its "
                    "end: on CUDA the host copy would hold the new bytes"
                )
            dst = copy.destination.tensor()
            if dst is None:
                continue  # freed: its watch reported device memory; host memory is freed only after the copies
            dst.copy_(source)
            self.carried_out += 1

    def _raise_faults(self) -> None:
        found = faults()
        if found:
            raise PendingCopyError(found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))
