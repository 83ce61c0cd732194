"""Peak bytes of live tensor storage on CPU, for the dry run's emulated device memory.

``torch.cuda.max_memory_allocated`` has no CPU counterpart and PyTorch's ``MemTracker`` refuses
models with frozen parameters (LoRA), so this counts storages directly: every storage an operator
creates is added when it appears and removed when it is freed; views share their storage.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StoragePeak(TorchDispatchMode):
    """While active, tracks the bytes of all live storages it knows of; ``peak`` is the maximum seen.

    Storages that exist before (parameters, optimizer state) are counted through :meth:`track`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _forget(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        size = storage.nbytes()
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._forget, key)

    def track(self, tensors: Iterable[torch.Tensor]) -> StoragePeak:
        """Count already existing ``tensors`` (each storage once)."""
        for tensor in tensors:
            self._add(tensor)
        return self

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                self._add(leaf)
        return out
