"""Every storage allocation and release of a piece of PyTorch code, in request order, as MEMO's malloc/free events.

An :class:`AllocationRecorder` is a ``TorchDispatchMode``: each op's outputs are looked at, and a
storage seen for the first time is a ``malloc``; a weak reference on it turns its death into the
matching ``free``. Views and in-place ops return storages already seen, so they add nothing;
``UntypedStorage.resize_`` and ops that resize their output are recorded as a free of the old size
and a malloc of the new one. Works on fake tensors (no memory needed) and on real ones.

Each event is tagged with the phase of the step it happened in (from a ``phase`` callable), the
storage's location and owned-buffer name (from :mod:`hf_memo.profiler.placement` tags) and, when the
recording is finished, its category:

- ``parameter``, ``buffer``, ``gradient``, ``optimizer``: storages labelled so by the caller;
- ``activation``: created by the forward pass and still alive after the phase that created it
  (saved for backward, or passed on to the next layer);
- ``temporary``: everything else (short-lived forward intermediates, anything created in backward,
  including recomputation, and optimizer scratch).

A ``workspace`` hook adds what a kernel allocates and frees inside one op, which no output shows (the CUDA
attention kernels' workspace, in a profile that runs the CPU kernel: :mod:`hf_memo.profiler.kernel_workspace`):
right after the op's outputs, a ``malloc`` of each buffer, then its ``free`` (``temporary``, sourced
``"<op> > <kernel> workspace <buffer>"``).
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from hf_memo.profiler import placement
from hf_memo.profiler.kernel_workspace import PROFILED_TARGET, Workspace
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace

_DEVICE = torch.ops.prim.device.default
_NAMES: dict[Any, str] = {}  # op -> its name ("aten.mm.default")
_UNSEEN = object()
LABELS = ("parameter", "buffer", "gradient", "optimizer", "activation")
WorkspaceHook = Callable[[Any, tuple, dict], Workspace | None]  # (op, args, kwargs) -> what the op allocates inside


@dataclass(frozen=True)
class StorageTag:
    """What the recorder knows about one malloc, keyed by where it is (to tag a CUDA allocator trace)."""

    address: int
    size: int
    phase: str
    category: str
    location: str
    name: str | None


@dataclass
class _Storage:
    """What is known about one allocation (one trace id)."""

    size: int
    stage: str
    phase: str
    address: int | None = None
    location: str = "device"
    name: str | None = None
    label: str | None = None
    free_stage: str | None = None
    free_phase: str | None = None


def _storages(value: Any) -> list[torch.UntypedStorage]:
    if isinstance(value, torch.Tensor):  # most ops' output: no need to flatten
        return [value.untyped_storage()] if value.layout == torch.strided else []
    found = []
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
            found.append(leaf.untyped_storage())
    return found


class AllocationRecorder(TorchDispatchMode):
    """Records storage mallocs and frees while active.

    Args:
        phase: returns the phase name of the code running now (see :class:`PhaseTracker`).
        stage: returns ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"`` (decides
            activation vs temporary).
        workspace: called with each op and its arguments, returns what the op allocates and frees inside
            itself (``None`` or an empty workspace: nothing).

    Tensors that exist before recording starts are added with :meth:`track`; categories are set
    with :meth:`label`. :meth:`trace` gives the result once the recorder has exited.
    """

    def __init__(
        self, phase: Callable[[], str], stage: Callable[[], str], workspace: WorkspaceHook | None = None
    ) -> None:
        super().__init__()
        self._phase = phase
        self._stage = stage
        self._workspace = workspace
        self._ids = WeakIdKeyDictionary()  # storage -> trace id
        self._refs: dict[int, weakref.ref | None] = {}  # live trace id -> weak reference with the free callback
        self._info: dict[int, _Storage] = {}
        self._events: list[tuple[str, int, str]] = []  # (op, id, phase)
        self._sources: dict[int, str] = {}  # trace id -> the op whose output it first was
        self._op: tuple[str, str] | None = None  # the op before the one being dispatched, and that one
        self._previous_op = ""
        self._part: tuple[str, str] | None = None  # (phase, name) of the part the runtime marked last
        self._part_ordinals: Counter[str] = Counter()  # outputs of each op so far in that part
        self._original_resize = torch.UntypedStorage.resize_
        self._recording = False
        self._stage_starts: dict[str, int] = {}

    def mark_stage(self, stage: str) -> None:
        """Note that ``stage`` starts now: its first event index goes to the trace's ``meta["stage_starts"]``."""
        self._stage_starts.setdefault(stage, len(self._events))

    # -- recording ---------------------------------------------------------------------------------

    def _malloc(self, storage: torch.UntypedStorage) -> int:
        tensor_id = len(self._info)
        phase = self._phase()
        address = None if storage.device.type == "meta" else storage.data_ptr()  # fake storages are meta
        self._info[tensor_id] = _Storage(storage.nbytes(), self._stage(), phase, address)
        self._ids[storage] = tensor_id
        self._refs[tensor_id] = weakref.ref(storage, partial(self._on_death, tensor_id))
        if self._op is not None:
            self._sources[tensor_id] = self._source(" > ".join(self._op), phase)
        self._retag(storage, tensor_id)
        self._events.append(("malloc", tensor_id, phase))
        return tensor_id

    def _source(self, op: str, phase: str) -> str:
        """``op``, and within a part the runtime marked in ``phase`` (:func:`~.placement.mark_part`), which
        part and the how-manyth output of ``op`` in it this is: ``"a > b @ part #2"``."""
        if self._part is None or self._part[0] != phase:
            return op
        ordinal = self._part_ordinals[op]
        self._part_ordinals[op] += 1
        return f"{op} @ {self._part[1]} #{ordinal}"

    def _on_part(self, name: str) -> None:
        self._part = (self._phase(), name)
        self._part_ordinals.clear()

    def _free(self, tensor_id: int) -> None:
        if tensor_id not in self._refs:
            return
        del self._refs[tensor_id]
        info = self._info[tensor_id]
        info.free_stage, info.free_phase = self._stage(), self._phase()
        self._events.append(("free", tensor_id, info.free_phase))

    def _record_workspace(self, op: str, workspace: Workspace) -> None:
        """Events of the buffers ``op`` allocates and frees inside itself (on the device, no storage behind them)."""
        live: dict[str, int] = {}  # buffer name -> trace id
        for event, buffer in workspace.events:
            if event == "free":
                self._free(live.pop(buffer.name))
                continue
            tensor_id = live[buffer.name] = len(self._info)
            phase = self._phase()
            self._info[tensor_id] = _Storage(buffer.nbytes, self._stage(), phase)
            self._refs[tensor_id] = None
            self._sources[tensor_id] = f"{op} > {workspace.kernel} workspace {buffer.name}"
            self._events.append(("malloc", tensor_id, phase))
        for tensor_id in reversed(live.values()):  # freed as the kernel returns (C++ locals: last made, first freed)
            self._free(tensor_id)

    def _on_death(self, tensor_id: int, _ref: weakref.ref) -> None:
        if self._recording:
            self._free(tensor_id)

    def _retag(self, storage: torch.UntypedStorage, tensor_id: int) -> None:
        info = self._info[tensor_id]
        info.location = placement.location_of(storage)
        info.name = placement.owner_of(storage)

    def _see(self, storage: torch.UntypedStorage) -> int | None:
        """The trace id of ``storage``: a malloc if it is new, a free and a malloc if its size changed.

        Empty storages hold no memory and get no id (resizing one to 0 bytes frees it).
        """
        tensor_id = self._ids.get(storage, _UNSEEN)  # None: seen empty
        size = storage.nbytes()
        if tensor_id is not None and tensor_id is not _UNSEEN:
            if self._info[tensor_id].size == size:
                return tensor_id
            self._free(tensor_id)
        elif tensor_id is None and size == 0:
            return None
        if size == 0:
            self._ids[storage] = None
            return None
        return self._malloc(storage)

    def _resize_recording(self) -> Callable[[torch.UntypedStorage, int], Any]:
        original = self._original_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            if storage in self._ids:
                self._see(storage)
            return result

        return resize_

    def _on_tag(self, storage: torch.UntypedStorage) -> None:
        tensor_id = self._ids.get(storage)
        if tensor_id is not None:
            self._retag(storage, tensor_id)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _DEVICE and is_fake(args[0]):
            # Autograd and the optimizers ask every tensor its device, more often than all other ops together; it
            # allocates nothing, so it is answered here as the fake tensor's own handler would.
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        out = func(*args, **(kwargs or {}))
        name = _NAMES.get(func) or _NAMES.setdefault(func, str(func))
        self._op, self._previous_op = (self._previous_op, name), name
        try:
            for storage in _storages(out):
                self._see(storage)
        finally:
            self._op = None
        if self._workspace is not None and (workspace := self._workspace(func, args, kwargs or {})) is not None:
            self._record_workspace(name, workspace)
        return out

    def __enter__(self) -> AllocationRecorder:
        # Cyclic garbage is freed at the end, not at the collector's whim. Nothing is collected
        # meanwhile, so everything made while recording is still in the youngest generation.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._recording = True
        torch.UntypedStorage.resize_ = self._resize_recording()  # type: ignore[method-assign]
        placement.add_tag_watcher(self._on_tag)
        placement.add_part_watcher(self._on_part)
        self._target = PROFILED_TARGET.set(getattr(self._workspace, "target", None))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        PROFILED_TARGET.reset(self._target)
        placement.remove_tag_watcher(self._on_tag)
        placement.remove_part_watcher(self._on_part)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        gc.collect(0)
        if self._gc_was_enabled:
            gc.enable()
        self._recording = False

    # -- what the caller knows ---------------------------------------------------------------------

    def track(self, value: Any, label: str | None = None) -> None:
        """Record the storages of the tensors in ``value`` (any pytree) if new, optionally labelling them."""
        for storage in _storages(value):
            tensor_id = self._see(storage)
            if label is not None and tensor_id is not None:
                self._set_label(tensor_id, label)

    def label(self, value: Any, label: str) -> None:
        """Give the storages of the tensors in ``value`` the category ``label`` (they must be recorded)."""
        for storage in _storages(value):
            tensor_id = self._ids.get(storage)
            if tensor_id is not None:
                self._set_label(tensor_id, label)

    def _set_label(self, tensor_id: int, label: str) -> None:
        if label not in LABELS:
            raise ValueError(f"label must be one of {', '.join(LABELS)}, got {label!r}")
        self._info[tensor_id].label = label

    # -- result ------------------------------------------------------------------------------------

    def _category(self, info: _Storage) -> str:
        if info.label is not None:
            return info.label
        outlives_phase = info.free_phase is None or info.free_stage != "forward" or info.free_phase != info.phase
        return "activation" if info.stage == "forward" and outlives_phase else "temporary"

    def trace(self, meta: dict[str, Any] | None = None) -> AllocationTrace:
        """The recorded events; ``meta["live_at_end"]`` lists the ids never freed (still alive) and
        ``meta["stage_starts"]`` the first event index of each stage marked with :meth:`mark_stage`."""
        events = []
        for op, tensor_id, phase in self._events:
            info = self._info[tensor_id]
            source = self._sources.get(tensor_id) if op == "malloc" else None
            events.append(
                AllocationEvent(op, tensor_id, info.size, phase, self._category(info), info.location, info.name, source)
            )
        live = sorted(self._refs)
        return AllocationTrace(events, {**(meta or {}), "live_at_end": live, "stage_starts": dict(self._stage_starts)})

    def storage_tags(self) -> list[StorageTag]:
        """Every malloc of real (not fake) memory in order, with its address, size and final tags."""
        return [
            StorageTag(info.address, info.size, info.phase, self._category(info), info.location, info.name)
            for op, tensor_id, _ in self._events
            if op == "malloc" and (info := self._info[tensor_id]).address is not None
        ]
