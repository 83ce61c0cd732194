"""Summing parameter gradients over mini-sequences without losing precision."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GradSum:
    """Running sums of the gradients of ``params`` over chunks.

    Half-precision parameters are summed in float32 and cast back at the end, so N chunks lose no
    more precision than the single full-length matmul they replace. ``None`` entries (parameters
    that need no gradient, or were unused) stay ``None``.
    """

    def __init__(self, params: Sequence[torch.Tensor], wanted: Sequence[bool]) -> None:
        self._dtypes = [p.dtype for p in params]
        self._sums: list[torch.Tensor | None] = [None] * len(params)
        self.wanted = list(wanted)

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one chunk's gradients (same order as ``params``; unwanted entries are ignored)."""
        for i, grad in enumerate(grads):
            if grad is None or not self.wanted[i]:
                continue
            if self._sums[i] is None:
                wide = torch.promote_types(grad.dtype, torch.float32)
                self._sums[i] = grad.to(wide, copy=True)
            else:
                self._sums[i].add_(grad)

    def result(self) -> list[torch.Tensor | None]:
        """The sums, each in its parameter's dtype."""
        return [None if total is None else total.to(dtype) for total, dtype in zip(self._sums, self._dtypes)]
