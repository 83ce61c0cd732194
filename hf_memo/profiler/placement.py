"""Tags the runtime puts on tensor storages, so a profile can tell where a tensor lives and who owns it.

The host pool marks the buffers it hands out as host memory; buffers hf_memo allocates for itself
(prefetch buffers, ...) are marked with a stable name the memory planner can key offsets by. Tags are
weak: they disappear with the storage. The runtime also marks where a repeating part of a layer's work
starts (:func:`mark_part`), so a profile can tell the same op at different places of a chunk apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_HOST = WeakIdKeyDictionary()
_NAMES = WeakIdKeyDictionary()
_WATCHERS: list[Callable[[torch.UntypedStorage], None]] = []
_PART_WATCHERS: list[Callable[[str], None]] = []


def add_tag_watcher(watcher: Callable[[torch.UntypedStorage], None]) -> None:
    """Call ``watcher(storage)`` whenever a storage is tagged (profilers use it: tags come after allocation)."""
    _WATCHERS.append(watcher)


def remove_tag_watcher(watcher: Callable[[torch.UntypedStorage], None]) -> None:
    """Stop calling ``watcher``."""
    _WATCHERS.remove(watcher)


def add_part_watcher(watcher: Callable[[str], None]) -> None:
    """Call ``watcher(name)`` whenever the runtime marks the start of a part (see :func:`mark_part`)."""
    _PART_WATCHERS.append(watcher)


def remove_part_watcher(watcher: Callable[[str], None]) -> None:
    """Stop calling ``watcher``."""
    _PART_WATCHERS.remove(watcher)


def mark_part(name: str) -> None:
    """Record that a part of a layer's work that repeats starts now (``name`` says which kind, e.g. the backward of
    a chunk whose activations were kept): a profile numbers each op's outputs within the part, so the same op at
    two places of every chunk makes two moments, not one. Nothing happens when nothing profiles."""
    for watcher in _PART_WATCHERS:
        watcher(name)


def _tagged(storage: torch.UntypedStorage) -> None:
    for watcher in _WATCHERS:
        watcher(storage)


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Record that ``tensor``'s storage is host memory standing in for device memory (offloading)."""
    _HOST[tensor.untyped_storage()] = True
    _tagged(tensor.untyped_storage())
    return tensor


def mark_owned(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Record that ``tensor``'s storage is hf_memo's buffer ``name`` (stable across steps)."""
    _NAMES[tensor.untyped_storage()] = name
    _tagged(tensor.untyped_storage())
    return tensor


def location_of(storage: torch.UntypedStorage) -> str:
    """``"host"`` for storages marked by :func:`mark_host`, else ``"device"``."""
    return "host" if storage in _HOST else "device"


def owner_of(storage: torch.UntypedStorage) -> str | None:
    """The name given by :func:`mark_owned`, or ``None``."""
    return _NAMES.get(storage)
