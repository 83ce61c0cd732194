"""The memo executor's per-layer memory policy: what each decoder layer keeps for backward, and where.

A layer always keeps its input ``X``. Under the MEMO policy it also keeps its attention output and
softmax statistics, so attention is never recomputed; a layer that keeps ``X`` only recomputes its
attention in backward (as checkpointing does) and keeps half the bytes. Of every other saved
activation, the first ``alpha`` of the tokens are kept and the rest are recomputed token-wise. The
kept tensors live in host memory or on the device.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerPolicy:
    """One decoder layer's policy.

    Attributes:
        keep_attention: keep the attention output ``(B, S, h*D)`` and statistics ``(B, h, S)`` (attention
            never recomputed); ``False``: keep the layer input only and recompute attention in backward.
        on_host: the kept tensors go to host memory (copied on a side stream); ``False``: they stay on the device.
        alpha: fraction of the tokens whose other saved activations are kept rather than recomputed
            (rounded down to whole mini-sequence chunks by the executor).
    """

    keep_attention: bool = True
    on_host: bool = True
    alpha: float = 0.0

    def kind(self) -> str:
        """``"X+attn/host"``, ``"X/device"``...: what is kept and where, without alpha."""
        return f"{'X+attn' if self.keep_attention else 'X'}/{'host' if self.on_host else 'device'}"


@dataclass(frozen=True)
class MemoryPolicy:
    """Every decoder layer's policy for one step shape, with what the solver predicted for it.

    Attributes:
        layers: one :class:`LayerPolicy` per decoder layer, bottom first.
        predicted_step_seconds: the cost model's step time (``None`` when not predicted, e.g. a fixed policy).
        device_bytes: the device bytes the kept tensors and copy buffers need at peak (``None``: not computed).
        host_bytes: the host bytes the kept tensors need (``None``: not computed).
        bound: what limited the solution (e.g. ``"bandwidth"``, ``"device memory"``, ``"host memory"``).
    """

    layers: tuple[LayerPolicy, ...]
    predicted_step_seconds: float | None = None
    device_bytes: float | None = None
    host_bytes: float | None = None
    bound: str = ""

    def summary(self) -> str:
        """Layers per kind and alpha in one line, e.g. ``"30 X+attn/host (alpha 0.25), 2 X/device"``."""
        counts = Counter((layer.kind(), layer.alpha) for layer in self.layers)
        return ", ".join(
            f"{count} {kind}" + (f" (alpha {alpha:.3g})" if alpha else "") for (kind, alpha), count in counts.items()
        )
