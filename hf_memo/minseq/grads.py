"""Summing parameter gradients over mini-sequences without losing precision."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def summing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of gradients in ``dtype`` is kept in: float32 for half precision, else ``dtype`` itself."""
    return torch.promote_types(dtype, torch.float32)


class GradSum:
    """Running sums of the gradients of ``params`` over chunks.

    Half-precision parameters are summed in float32 and cast back at the end, so N chunks lose no
    more precision than the single full-length matmul they replace. ``None`` entries (parameters
    that need no gradient, or were unused) stay ``None``.
    """

    def __init__(self, params: Sequence[torch.Tensor], wanted: Sequence[bool]) -> None:
        self._params = params
        self._dtypes = [p.dtype for p in params]
        self._sums: list[torch.Tensor | None] = [None] * len(params)
        self._added = [False] * len(params)
        self.wanted = list(wanted)

    def reserve(self) -> None:
        """Allocate every wanted sum now (zeros shaped like its parameter), not at its first chunk: the memory a
        backward holds is then the same from its first chunk to its last. A parameter no chunk adds to still
        gets ``None``."""
        for i, param in enumerate(self._params):
            if self.wanted[i] and self._sums[i] is None:
                self._sums[i] = torch.zeros_like(param, dtype=summing_dtype(param.dtype))

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one chunk's gradients (same order as ``params``; unwanted entries are ignored)."""
        for i, grad in enumerate(grads):
            if grad is None or not self.wanted[i]:
                continue
            if self._sums[i] is None:
                self._sums[i] = grad.to(summing_dtype(grad.dtype), copy=True)
            else:
                self._sums[i].add_(grad)
            self._added[i] = True

    def result(self) -> list[torch.Tensor | None]:
        """The sums, each in its parameter's dtype (``None`` where no chunk added a gradient)."""
        return [
            total.to(dtype) if added else None for total, dtype, added in zip(self._sums, self._dtypes, self._added)
        ]
