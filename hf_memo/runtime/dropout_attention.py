"""The attention dropout mask of the explicit kernel (:mod:`.explicit_attention`), regenerated instead of kept.

PyTorch's CPU flash kernel has no dropout, and the memo executor differentiates attention later without
running it again, so the explicit kernel's mask is *counter based*: whether the probability of query ``i``
attending to key ``j`` in head ``n`` of sequence ``b`` is kept is a hash of ``(seed, b, n, i, j)``
(:func:`keep_mask`). The forward draws ``seed`` from PyTorch's CPU generator (:func:`draw_seed`: so
``torch.manual_seed`` reproduces a step and every call draws a fresh mask) and keeps only that integer; the
backward regenerates the mask of each block from it. The mask never depends on the block sizes, and no
``(S, S)`` tensor is kept. The hash costs about ten integer operations per score.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

_MASK32 = 0xFFFFFFFF


def draw_seed() -> int:
    """A fresh 32-bit mask seed from PyTorch's default CPU generator (advances it like a dropout call).

    Under ``FakeTensorMode`` (memory profiling, e.g. the planner's fake step) no value exists and none
    matters: the seed is 0.
    """
    seed = torch.randint(0, 1 << 32, (), dtype=torch.int64)
    return 0 if is_fake(seed) else int(seed)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without overflowing int64 (16-bit halves)."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift / multiply rounds) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keep_mask(
    seed: int,
    p: float,
    batch: int,
    heads: int,
    seq: int,
    rows: tuple[int, int],
    keys: int,
    device: torch.device,
    first_key: int = 0,
) -> torch.Tensor:
    """Which attention probabilities survive dropout: ``(B, h, stop - start, keys - first_key)`` bool for query
    rows ``rows = (start, stop)`` against keys ``[first_key, keys)`` of a ``seq``-token self-attention.

    Each element is kept with probability ``1 - p`` independently of the others, as a function of
    ``(seed, b, n, i, j)`` only: any block of the ``(B, h, S, S)`` mask is the same slice of the whole.
    """
    start, stop = rows
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    n = torch.arange(heads, device=device).view(1, -1, 1, 1)
    i = torch.arange(start, stop, device=device).view(1, 1, -1, 1)
    j = torch.arange(first_key, keys, device=device).view(1, 1, 1, -1)
    counter = ((b * heads + n) * seq + i) * seq + j  # unique per element, < 2**63 for any real shape
    bits = _mix32((counter & _MASK32) ^ _mix32((counter >> 32) ^ (seed & _MASK32)))
    return bits >= int(round(p * (1 << 32)))
