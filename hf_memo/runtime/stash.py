"""What one decoder layer keeps between its forward and its backward, and where it keeps it.

A :class:`LayerStash` collects the layer's saved tensors during forward (the layer input, the
attention output and statistics, and the saved activations of its offloaded tokens), by storage, so
views are kept once. When the layer's forward ends it is *sealed*: for a swapped layer each storage
is copied straight into its place in a pooled host buffer on the device-to-host stream (no device
staging buffer), and the stash keeps its device tensors until the copies are waited on: when the next stash of the
device is sealed, or backward begins (:class:`CopiesInFlight`). So at most one stash's copies are in flight, and their
memory is held by tensors, as any profile sees it. In backward the bytes come back into one of two prefetch
buffers, as large as the layer keeps — ahead of time, while the layer above computes — and every saved tensor is
rebuilt as a view with its original shape and strides. A prefetch buffer is given back as soon as its layer's backward
is done. Where the layer above frees memory gradually during its backward (its keys' gradient sums, chunk by
chunk), the bytes come ahead in pieces of their own, each fetched as memory goes back, and are joined into the
prefetch buffers when the layer's backward begins. A storage whose saved views are read one at a time (the
attention output, chunk by chunk) is not fetched with the rest: each view's bytes come into a tensor of their own
when it is rebuilt, or ahead of time (:meth:`LayerStash.fetch_view`).
"""

from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

from hf_memo.profiler.placement import mark_owned
from hf_memo.runtime.arena import Arena
from hf_memo.runtime.offload import CopyEngine, HostMemoryUnavailable, HostPool

ALIGN = 512


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class StashRef:
    """Where one saved tensor lives in a stash: storage ``index`` plus the tensor's view of it."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class DeviceSlots:
    """Two alternating sets of flat device buffers, ``"<name> <slot>"`` (and ``"<name> <slot>.<part>"``), one set per
    stash being fetched.

    A slot's buffers are made when a stash acquires it, as large as that stash's parts, and given back when the
    stash's backward is done (:meth:`release`): only the stash being differentiated and the one fetched ahead of it
    hold device bytes. The buffers come from the memory plan's arena when there is one, else from PyTorch's
    allocator (on CUDA, a new buffer's bytes are written on the copy stream only after the compute stream's work
    queued so far, which includes every read of the memory's previous use).

    A slot has at most one holder, the stash whose bytes it holds: handing the slot to another stash, or
    giving the buffers back, evicts the holder (:meth:`LayerStash.evict`), which fetches again when it
    needs its bytes. With several graphs alive, stashes of different graphs take turns in the same slots.

    ``planned``: the steps' memory is planned (``MemoConfig.planner`` on), in the profile that makes the plan and in
    the steps its arena serves alike, so both fetch the same way: a stash whole into its buffers, ahead of its
    backward (no pieces, no storage read in views), as the arena's regions are laid out for.
    """

    def __init__(
        self,
        name: str,
        device: torch.device,
        engine: CopyEngine,
        arena: Arena | None = None,
        planned: bool = False,
    ) -> None:
        self.name, self.device, self.engine, self.arena = name, device, engine, arena
        self.planned = planned or arena is not None
        self._buffers: list[list[torch.Tensor]] = [[], []]
        self._holders: list[weakref.ref[LayerStash] | None] = [None, None]

    def acquire(self, slot: int, sizes: list[int], holder: LayerStash) -> list[torch.Tensor]:
        """``(sizes[i],)`` uint8 buffers for ``slot``, held by ``holder`` from now on (the previous holder is
        evicted and its buffers given back)."""
        self._evict(slot, keep=holder)
        if self._holder(slot) is not holder or [b.numel() for b in self._buffers[slot]] != sizes:
            self._drop(slot)
            self._buffers[slot] = [self._new(self._buffer_name(slot, part), size) for part, size in enumerate(sizes)]
        self._holders[slot] = weakref.ref(holder)
        return self._buffers[slot]

    def _buffer_name(self, slot: int, part: int) -> str:
        return f"{self.name} {slot}" if part == 0 else f"{self.name} {slot}.{part}"

    def _new(self, name: str, nbytes: int) -> torch.Tensor:
        if self.arena is not None:
            return self.arena.take(name, (nbytes,), torch.uint8)
        return mark_owned(torch.empty(nbytes, dtype=torch.uint8, device=self.device), name)

    @property
    def buffers_outlive_release(self) -> bool:
        """Whether a buffer's memory stays valid while a tensor references it after :meth:`release` (the allocator's
        buffers; an arena's region goes to the next name that takes it)."""
        return self.arena is None

    def release(self, slot: int, holder: LayerStash) -> None:
        """``holder``'s backward is done with ``slot``: its buffers are given back (if ``holder`` still holds it)."""
        if self._holder(slot) is holder:
            self._holders[slot] = None
            self._drop(slot)

    def release_all(self) -> None:
        """Give both slots' buffers back, evicting their holders."""
        for slot in (0, 1):
            self._evict(slot)
            self._drop(slot)

    def _holder(self, slot: int) -> LayerStash | None:
        ref = self._holders[slot]
        return None if ref is None else ref()

    def _evict(self, slot: int, keep: LayerStash | None = None) -> None:
        holder = self._holder(slot)
        if holder is not None and holder is not keep:
            holder.evict()
            self._holders[slot] = None

    def _drop(self, slot: int) -> None:
        if self.arena is not None:
            for part in range(len(self._buffers[slot])):
                self.arena.release(self._buffer_name(slot, part))
        self._buffers[slot] = []

    @property
    def reserved_bytes(self) -> int:
        return sum(b.numel() for buffers in self._buffers for b in buffers)


def _runs(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, list[int]]:
    """The elements of a view of ``shape`` and ``stride`` (in elements, not overlapping) as runs of consecutive
    elements of its storage: ``(elements per run, each run's first element from the view's first)``, in memory order
    (e.g. a ``(B, h, rows, D)`` view of ``(B, S, h, D)`` memory: ``B`` runs of ``rows * h * D``)."""
    if 0 in shape:
        return 0, []
    dims = sorted(((step, size) for size, step in zip(shape, stride) if size > 1), reverse=True)  # outermost first
    run = 1
    while dims and dims[-1][0] == run:  # the innermost dimensions that continue one another make one run
        run *= dims.pop()[1]
    starts = [0]
    for step, size in dims:
        starts = [start + i * step for start in starts for i in range(size)]
    return run, starts


def _view_inside(held: StashRef, view: torch.Tensor, ref: StashRef) -> torch.Tensor | None:
    """``ref``'s view as a view of ``view``, the dense copy of ``held``'s view of the same storage (see
    :meth:`LayerStash.fetch_view`), when ``ref``'s elements all lie in one run of ``held``'s (:func:`_runs`), where
    the two layouts differ by an offset only; else ``None``."""
    if ref.index != held.index or ref.dtype != held.dtype or 0 in ref.shape:
        return None
    run, starts = _runs(held.shape, held.stride)
    first = ref.offset - held.offset
    last = first + sum((size - 1) * step for size, step in zip(ref.shape, ref.stride))
    place = bisect.bisect_right(starts, first) - 1
    if place < 0 or last >= starts[place] + run:
        return None
    return torch.as_strided(view, ref.shape, ref.stride, view.storage_offset() + place * run + first - starts[place])


def _dense_stride(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dimensions are in the memory order of ``stride`` (the
    runs of :func:`_runs` side by side)."""
    dense, step = [1] * len(shape), 1
    for dim in sorted(range(len(shape)), key=lambda d: stride[d]):  # innermost first
        dense[dim] = step
        step *= shape[dim]
    return tuple(dense)


class CopiesInFlight:
    """The latest swapped stash of a device sealed with its device-to-host copies maybe still running: it keeps the
    copies' device tensors until they are waited on (:meth:`settle`), when the next stash of the device is sealed or
    backward begins (a stash is prefetched or rebuilt). At most one stash's copies are then in flight, and the
    memory they read is held by tensors, so the fake-tensor profiles the estimator and the policy sizer rely on count
    it (CUDA's caching allocator would keep a source marked with ``record_stream`` until its copy ends, a profile would
    free it at once and miss a stash per copy still running)."""

    def __init__(self) -> None:
        self._latest: weakref.ref[LayerStash] | None = None

    def hold(self, stash: LayerStash) -> None:
        """``stash`` was just sealed with its copies issued: the one before it settles."""
        self.settle()
        self._latest = weakref.ref(stash)

    def settle(self) -> None:
        """The latest stash's copies are waited on (on CUDA the compute stream waits) and its device tensors go."""
        stash = None if self._latest is None else self._latest()
        self._latest = None
        if stash is not None:
            stash.copied()


def _give_back(pool: HostPool, engine: CopyEngine, host: torch.Tensor, latest: list) -> None:
    """Give a stash's host buffer back to ``pool`` once the stash's ``latest`` copies are done (on CUDA the compute
    stream waits for them): the buffer's next owner must not meet a copy of this stash still reading or writing it."""
    for event in latest:
        engine.wait(event)
    pool.release(host)


class LayerStash:
    """Saved tensors of one layer: on the device until :meth:`seal`, then on the host if ``swapped``.

    ``keep_attention`` tells the executor what the layer keeps: its attention output and statistics too,
    or (``False``) its input only, attention being recomputed in backward. ``stretch``: new host buffers hold
    that many times the stash's bytes (the longest step of its length bucket, see
    :mod:`~hf_memo.runtime.buckets`), so the bucket's other steps reuse them. ``below`` is the stash of the
    layer below in the same forward (set by the runtime when this one is sealed; ``None`` for the lowest):
    backward prefetches it, and only it, so each graph's backward fetches its own bytes. ``in_flight``: the device's
    stash whose copies to the host may still run (the runtime's, shared by its stashes; by default one of its own).
    """

    def __init__(
        self,
        index: int,
        swapped: bool,
        engine: CopyEngine,
        pool: HostPool,
        prefetch: DeviceSlots,
        keep_attention: bool = True,
        stretch: float = 1.0,
        in_flight: CopiesInFlight | None = None,
    ) -> None:
        self.index, self.swapped, self.keep_attention, self.stretch = index, swapped, keep_attention, stretch
        self.below: weakref.ref[LayerStash] | None = None
        self._engine, self._pool, self._prefetch = engine, pool, prefetch
        self._in_flight = in_flight if in_flight is not None else CopiesInFlight()
        self._copying: list[torch.Tensor] = []  # the device storages the copies to the host read, until waited on
        self._storages: list[torch.Tensor] = []  # each whole storage as a 1-D tensor of its dtype
        self._index_of: dict[int, int] = {}  # storage address -> position (the storages below keep it unique)
        self._layout: list[tuple[int, int, torch.dtype]] = []  # (byte offset, bytes, dtype) per storage
        self.nbytes = 0  # aligned bytes of the sealed stash
        self._host: torch.Tensor | None = None
        self._return_host = lambda: None  # gives the host buffer back to the pool, once
        self._stored: torch.cuda.Event | None = None  # the device-to-host copy
        self._fetched: torch.cuda.Event | None = None
        # the latest device-to-host and host-to-device copies of this stash: waited on before their memory goes
        self._latest: list[torch.cuda.Event | None] = [None, None]
        self._slot_buffers: list[torch.Tensor] | None = None  # the fetched parts (see _parts)
        self._pieces: list[tuple[int, torch.Tensor]] = []  # (first byte, bytes) fetched ahead in pieces
        self._read_in_views: set[int] = set()  # storages fetched one saved view at a time, laid out last
        self._fetched_with_buffers = 0  # bytes of the layout the prefetch buffers hold: all but those storages
        self._view_fetches: dict[StashRef, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._held_views: dict[int, tuple[StashRef, torch.Tensor]] = {}  # storage index -> view held (hold_view)
        self._freed = False

    @property
    def device(self) -> torch.device:
        """The device the stash's tensors are on (and fetched back to)."""
        return self._engine.device

    def add(self, tensor: torch.Tensor, read_in_views: bool = False) -> StashRef:
        """Keep ``tensor`` (its whole storage, once per storage) and return how to rebuild it. ``read_in_views``:
        the storage's views are rebuilt one at a time (not the storage whole), so a swapped stash fetches each
        view's bytes when it is rebuilt instead of the storage with the rest."""
        storage = tensor.untyped_storage()
        if storage._cdata not in self._index_of:
            if read_in_views and not self._prefetch.planned:
                self._read_in_views.add(len(self._storages))
            self._index_of[storage._cdata] = len(self._storages)
            # detached: a stashed tensor must not reference the graph whose saved-tensor hooks reference the stash
            # (the view's base is that detached tensor: two tensors of the stash's on the storage, see ``owns``)
            whole = torch.as_strided(tensor.detach(), (storage.nbytes() // tensor.element_size(),), (1,), 0)
            self._storages.append(whole)
        return StashRef(
            self._index_of[storage._cdata],
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset(),
        )

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the distinct storages collected so far (unaligned)."""
        return sum(whole.numel() * whole.element_size() for whole in self._storages)

    @property
    def lower(self) -> LayerStash | None:
        """The live stash of the layer below in the same forward, if any."""
        return None if self.below is None else self.below()

    def seal(self) -> None:
        """End of forward: no more tensors; a swapped stash moves to the host (asynchronously on CUDA), its device
        tensors kept until its copies are waited on (:class:`CopiesInFlight`). The stash sealed before it on the
        device settles: its copies are waited on, its device tensors go."""
        self._in_flight.settle()
        self._index_of = {}
        self._layout = [(0, 0, torch.uint8)] * len(self._storages)
        order = sorted(range(len(self._storages)), key=lambda index: index in self._read_in_views)
        for index in order:  # the storages read in views last: the prefetch buffers hold the bytes before them
            whole = self._storages[index]
            nbytes = whole.numel() * whole.element_size()
            self._layout[index] = (self.nbytes, nbytes, whole.dtype)
            self.nbytes += _aligned(nbytes)
        self._fetched_with_buffers = min((self._layout[i][0] for i in self._read_in_views), default=self.nbytes)
        if not self.swapped:
            return
        try:
            self._host = self._pool.acquire(self.nbytes, capacity=self._capacity)
        except HostMemoryUnavailable as error:
            self.swapped = False  # the stash stays on the device: a smaller swap set, the same gradients
            self._pool.warn_once(
                f"hf_memo: layer {self.index}'s activations stay on the device: {error}. Offloading continues with "
                "the stashes the host has room for; MemoConfig.host_memory_limit sets the host's share"
            )
            return
        for whole, view in zip(self._storages, self._views([self._host])):
            self._stored = self._latest[0] = self._engine.to_host(view, whole)
        # Returned after backward, or when the stash is dropped without one (e.g. a forward never differentiated:
        # the finalizer waits for the copies before the device tensors go with the stash).
        self._return_host = weakref.finalize(self, _give_back, self._pool, self._engine, self._host, self._latest)
        self._copying, self._storages = self._storages, []
        self._in_flight.hold(self)

    def copied(self) -> None:
        """Wait for the copies to the host (on CUDA the compute stream waits) and let their device tensors go."""
        if self._copying:
            self._engine.wait(self._stored)
            self._copying = []

    def _parts(self) -> list[tuple[int, int]]:
        """Byte ranges of the device buffers a swapped stash is fetched into: its first storage (the layer input) in
        a buffer of its own, so that memory can outlive the rest (see :meth:`owns`), and the other storages."""
        first = _aligned(self._layout[0][1]) if self._layout else 0
        last = self._fetched_with_buffers
        return [(start, stop) for start, stop in ((0, first), (first, last)) if stop > start]

    def prefetch(self, nbytes: int | None = None) -> None:
        """Start copying a swapped stash back to the device: all of it into its prefetch buffers, or its first
        ``nbytes``, beyond those on their way, into a piece of its own (:meth:`rebuild` joins the pieces into the
        buffers). No-op for what is there or on its way. Planned slots (:class:`DeviceSlots`) take the whole stash
        at the first call."""
        self._in_flight.settle()  # backward has begun
        if not self.swapped or self._slot_buffers is not None or self._host is None:
            return
        if (nbytes is None or self._prefetch.planned) and not self._pieces:
            parts, buffers = self._acquire_buffers()
            for buffer, (start, stop) in zip(buffers, parts):
                self._fetched = self._latest[1] = self._engine.to_device(buffer, self._host[start:stop], self._stored)
            self._slot_buffers = buffers
            return
        start = self._pieces[-1][0] + self._pieces[-1][1].numel() if self._pieces else 0
        last = self._fetched_with_buffers
        stop = last if nbytes is None else min(last, nbytes)
        if stop > start:
            piece = torch.empty(stop - start, dtype=torch.uint8, device=self._prefetch.device)
            self._fetched = self._latest[1] = self._engine.to_device(piece, self._host[start:stop], self._stored)
            self._pieces.append((start, piece))

    def _acquire_buffers(self) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
        """The byte ranges of :meth:`_parts` and the prefetch slot's buffers for them, held by this stash."""
        parts = self._parts()
        return parts, self._prefetch.acquire(self.index % 2, [stop - start for start, stop in parts], holder=self)

    def _join_pieces(self) -> None:
        """Copy the pieces fetched ahead into the prefetch buffers, each piece given back once its bytes are in."""
        parts, buffers = self._acquire_buffers()
        for buffer, (start, stop) in zip(buffers, parts):
            for first, piece in self._pieces:
                low, high = max(start, first), min(stop, first + piece.numel())
                if low < high:
                    buffer[low - start : high - start].copy_(piece[low - first : high - first])
            self._pieces = [(first, piece) for first, piece in self._pieces if first + piece.numel() > stop]
        self._slot_buffers = buffers

    @property
    def _capacity(self) -> int:
        return math.ceil(self.nbytes * self.stretch)

    def evict(self) -> None:
        """The prefetch slot holding this stash's bytes went to another stash (or back to the arena): a swapped
        stash fetches again from the host when it is next rebuilt."""
        if self.swapped:
            self._engine.wait(self._latest[1])  # no copy may still write the buffers and pieces dropped here
            self._storages, self._slot_buffers, self._fetched, self._pieces = [], None, None, []
            self._view_fetches, self._held_views = {}, {}

    def rebuild(self, ref: StashRef) -> torch.Tensor:
        """The saved tensor ``ref`` describes, as a view of its storage on the device."""
        if self._freed:
            raise RuntimeError(
                f"layer {self.index}'s memo stash was freed by a backward through this graph; to differentiate "
                "a graph again, pass retain_graph=True to every backward but the last"
            )
        self._in_flight.settle()  # backward has begun
        if not self._storages:  # swapped: wait for the prefetch (or fetch now if none was started)
            self.prefetch()
            self._engine.wait(self._fetched)
            if self._pieces:
                self._join_pieces()
            self._storages = self._views(self._slot_buffers)
        base = self._storages[ref.index]
        if base is None:  # a storage read in views, on the host
            return self._read_view(ref)
        return torch.as_strided(base, ref.shape, ref.stride, base.storage_offset() + ref.offset)

    def _read_view(self, ref: StashRef) -> torch.Tensor:
        """``ref``'s view of a swapped storage read in views: a view of the view of it held on the device
        (:meth:`hold_view`) if it lies inside that, else fetched (or waited for, if fetched ahead)."""
        held = self._held_views.get(ref.index)
        inside = None if held is None else _view_inside(*held, ref)
        if inside is not None:
            return inside
        self.fetch_view(ref)
        view, fetched = self._view_fetches.pop(ref)
        self._engine.wait(fetched)
        return view

    def hold_view(self, ref: StashRef) -> torch.Tensor:
        """:meth:`rebuild` ``ref``, and where it comes from the host (a view of a storage read in views) keep it on
        the device until :meth:`drop_view`: the saved views inside it are rebuilt from it instead of fetched again
        (e.g. a chunk's attention-output rows ``(B, h, rows, D)``, and the rows ``(s, h * D)`` of each sequence its
        o-projection saved). A view held before of the same storage is let go first (its own tensor comes)."""
        self.drop_view(ref)
        view = self.rebuild(ref)
        if self._storages[ref.index] is None:
            self._held_views[ref.index] = (ref, view)
        return view

    def drop_view(self, ref: StashRef) -> None:
        """Let go of the view of ``ref``'s storage :meth:`hold_view` holds (its memory goes with the caller's last
        tensor on it); saved views inside it are fetched again if rebuilt."""
        self._held_views.pop(ref.index, None)

    def fetch_view(self, ref: StashRef) -> None:
        """Start copying the bytes of ``ref``'s view of a swapped storage read in views into a device tensor of their
        own, which its next :meth:`rebuild` returns (no-op for any other storage, or if on its way). Only the view's
        own bytes come, one copy per run of consecutive ones: a chunk's rows ``(B, h, rows, D)`` of ``(B, S, h, D)``
        memory are ``B`` runs, not the span from the first sequence's rows to the last's. The tensor is dense, its
        dimensions in the view's memory order."""
        if ref in self._view_fetches or ref.index not in self._read_in_views or not self.swapped:
            return
        if self._host is None:
            raise RuntimeError(f"layer {self.index}'s memo stash has no host copy to fetch a view from")
        size = ref.dtype.itemsize
        run, starts = _runs(ref.shape, ref.stride)
        first = self._layout[ref.index][0] + ref.offset * size
        piece = torch.empty(run * len(starts) * size, dtype=torch.uint8, device=self._prefetch.device)
        fetched = None
        for place, start in enumerate(starts):  # e.g. one run per sequence of a chunk's rows (B, h, rows, D)
            host = self._host[first + start * size : first + (start + run) * size]
            part = piece[place * run * size : (place + 1) * run * size]
            fetched = self._latest[1] = self._engine.to_device(part, host, self._stored)
        view = torch.as_strided(piece.view(ref.dtype), ref.shape, _dense_stride(ref.shape, ref.stride), 0)
        self._view_fetches[ref] = (view, fetched)

    def release(self, keep: bool = False) -> None:
        """After the layer's backward: give the prefetch buffer back; unless ``keep`` (the backward retains the
        graph, ``retain_graph=True``), also drop the device copy and give the host buffer back to the pool.
        A kept swapped stash is fetched from the host again by the next backward."""
        if self._slot_buffers is not None:
            self._prefetch.release(self.index % 2, self)
        if keep:
            self.evict()
            return
        self.copied()
        self._engine.wait(self._latest[1])  # no copy may still write the buffers and pieces dropped here
        self._return_host()
        self._storages, self._host, self._slot_buffers, self._pieces, self._freed = [], None, None, [], True
        self._view_fetches, self._held_views = {}, {}

    def owns(self, ref: StashRef, views: int = 1) -> bool:
        """Whether the memory of ``ref``'s storage on the device is this stash's alone, apart from ``views`` tensors
        the caller holds on it: no tensor outside references it, and it stays valid while a tensor does after
        :meth:`release`. The executor may then write the layer's input gradient into its input's memory once it has
        read it (and hand that memory on as the gradient), unless the graph is kept for another backward.

        A fetched stash owns its first storage's buffer when it comes from PyTorch's allocator (not an arena); a
        stash kept on the device owns a storage no other tensor is on (the layer's input after the caller let go of
        it, e.g. without ``output_hidden_states``)."""
        if self.swapped:
            return ref.index == 0 and self._slot_buffers is not None and self._prefetch.buffers_outlive_release
        if ref.index >= len(self._storages):
            return False
        whole = self._storages[ref.index]
        return _tensors_on(whole) == 2 + views  # ``whole`` and its base

    def _views(self, buffers: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each storage's tensor in ``buffers``: consecutive parts of the stash's byte layout (``None`` for a storage
        read in views that they do not hold: the prefetch buffers)."""
        starts, start = [], 0
        for buffer in buffers:
            starts.append(start)
            start += buffer.numel()
        views = []
        for index, (offset, nbytes, dtype) in enumerate(self._layout):
            if index in self._read_in_views and offset >= start:
                views.append(None)
                continue
            part = max(i for i, first in enumerate(starts) if first <= offset)
            local = offset - starts[part]
            views.append(buffers[part][local : local + nbytes].view(dtype))
        return views


def _storage_references(tensor: torch.Tensor) -> int:
    storage = tensor.untyped_storage()  # held while its address is read
    return torch._C._storage_Use_Count(storage._cdata)


_ONE_TENSOR = _storage_references(torch.empty(1))  # what one tensor alone on its storage reads


def _tensors_on(tensor: torch.Tensor) -> int:
    """Tensors referencing ``tensor``'s storage (itself included; a view counts once, and its base once more)."""
    return _storage_references(tensor) - _ONE_TENSOR + 1


def _from_kept_only(tensor: torch.Tensor, kept: set[int], kept_sizes: set[int]) -> bool:
    """Whether ``tensor`` is computed from the kept tensors (storage addresses ``kept``) alone, not from the
    layer's input: e.g. a weight's lower-precision copy under autocast. Such a tensor has no token
    dimension: it is the same for every token, recreated per call (or cached by autocast), never per-token.

    With a graph, autograd says it: every leaf it reaches is a kept tensor. Without one (a frozen weight's
    cast, a dropout mask), a floating tensor whose storage has as many elements as a kept tensor counts as
    its cast (whatever view of it was saved: transposed, or expanded over the batch).
    """
    if tensor.grad_fn is None:
        if tensor.requires_grad or not tensor.is_floating_point():
            return False
        return tensor.untyped_storage().nbytes() // tensor.element_size() in kept_sizes
    seen, todo = {}, [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node  # held, so ids stay unique during the walk
        leaf = getattr(node, "variable", None)  # AccumulateGrad: a leaf tensor
        if leaf is not None:
            if leaf.untyped_storage()._cdata not in kept:
                return False
            continue
        todo.extend(fn for fn, _ in node.next_functions)
    return True


class RecomputedInBackward:
    """A tensor the layer's backward computes again (the attention output of a layer keeping its input only):
    saved views of it keep their layout only, and are rebuilt as views of the recomputed tensor.

    ``forward_value`` is the forward's tensor (the hooks hold its storage address, not the tensor); backward
    sets :attr:`value` to the recomputed one, which must have the same shape, strides and dtype, before the
    graph that saved the views is differentiated.
    """

    def __init__(self, forward_value: torch.Tensor) -> None:
        self.storage = forward_value.untyped_storage()._cdata
        self.dtype = forward_value.dtype
        self.layout = (forward_value.shape, forward_value.stride(), forward_value.storage_offset())
        self.value: torch.Tensor | None = None

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage()._cdata == self.storage and tensor.dtype == self.dtype

    def pack(self, tensor: torch.Tensor) -> tuple:
        return (self, tensor.shape, tensor.stride(), tensor.storage_offset() - self.layout[2])

    def rebuild(self, shape: torch.Size, stride: tuple[int, ...], offset: int) -> torch.Tensor:
        value = self.value
        if value is None or (value.shape, value.stride(), value.dtype) != (*self.layout[:2], self.dtype):
            raise RuntimeError(
                "the attention output recomputed in backward must have the forward's shape, strides and dtype "
                f"{tuple(self.layout[0])}, {self.layout[1]}, {self.dtype}"
            )
        return value.as_strided(shape, stride, value.storage_offset() + offset)


def stash_hooks(
    stash: LayerStash, tensors: list[torch.Tensor], stash_them: bool, recomputed: RecomputedInBackward | None = None
) -> saved_tensors_hooks:
    """Saved-tensor hooks that put into ``stash`` the saved tensors sharing a storage with ``tensors``
    (``stash_them=True``), or every saved tensor computed from the layer's input (``stash_them=False``:
    not those, nor tensors computed from ``tensors`` alone, such as autocast's weight casts, which are
    the same for every token); the rest stay as they are, as do tensors on another device than the stash's
    (a host scalar saved by a CUDA layer: no copy stream may record it). Views of ``recomputed`` are neither: they
    are rebuilt from its value in backward.

    ``tensors`` must stay alive while the hooks are in use. The hooks hold no reference to them: the
    graph keeps its hooks, and a stashed tensor's device memory must be free to go once the stash
    has its bytes.
    """
    storages = {t.untyped_storage()._cdata for t in tensors}  # storage addresses, unique while alive
    sizes = {t.numel() for t in tensors}

    def pack(tensor: torch.Tensor):
        if recomputed is not None and recomputed.holds(tensor):
            return recomputed.pack(tensor)
        if tensor.device != stash.device:
            stashed = False
        elif stash_them:
            stashed = tensor.untyped_storage()._cdata in storages
        else:
            stashed = tensor.untyped_storage()._cdata not in storages and not _from_kept_only(tensor, storages, sizes)
        # Detached: a saved output holding its own grad_fn would make a cycle autograd never frees if the
        # graph is dropped without a backward (an aborted step). Autograd restores the metadata on unpack.
        return stash.add(tensor) if stashed else (tensor.detach(),)

    def unpack(packed) -> torch.Tensor:
        if isinstance(packed, tuple):
            return packed[0] if len(packed) == 1 else packed[0].rebuild(*packed[1:])
        return stash.rebuild(packed)

    return saved_tensors_hooks(pack, unpack)
