"""Peak memory by category with PyTorch's ``MemTracker`` (works under ``FakeTensorMode``, no GPU needed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker


@dataclass(frozen=True)
class PeakBreakdown:
    """Bytes alive at the moment of peak memory, by what they hold."""

    total: int
    parameter: int
    buffer: int
    gradient: int
    activation: int
    temporary: int
    optimizer: int

    @property
    def activations(self) -> int:
        """Everything but parameters, buffers, gradients and optimizer state (activations + temporaries)."""
        return self.activation + self.temporary

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "activations": self.activations}


_CATEGORY = {
    "Parameter": "parameter",
    "Buffer": "buffer",
    "Gradient": "gradient",
    "Activation": "activation",
    "Temp": "temporary",
    "Optstate": "optimizer",
}


def peak_of(fn: Callable[[], Any], *external: Any) -> PeakBreakdown:
    """Run ``fn`` under a ``MemTracker`` that also counts ``external`` modules/tensors; its peak by category.

    Objects created before the call (the model, its inputs) are only counted when passed in
    ``external``. With several devices the largest peak is reported.
    """
    tracker = MemTracker()
    if external:
        tracker.track_external(*external)
    with tracker:
        fn()
    snapshots = tracker.get_tracker_snapshot("peak")
    if not snapshots:
        return PeakBreakdown(0, 0, 0, 0, 0, 0, 0)
    snap = max(snapshots.values(), key=lambda s: s["Total"])
    counts = {name: 0 for name in _CATEGORY.values()}
    for key, value in snap.items():
        name = _CATEGORY.get(getattr(key, "value", key))
        if name is not None:
            counts[name] += value
    return PeakBreakdown(total=snap["Total"], **counts)


def training_step_peak(model: torch.nn.Module, batch_size: int, seq_len: int) -> PeakBreakdown:
    """Peak of one forward + backward of ``model`` on random ``(batch_size, seq_len)`` tokens with labels.

    Call inside the model's ``FakeTensorMode`` for fake profiling; parameters count as external.
    """
    vocab = model.config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab, (batch_size, seq_len))

    def step() -> None:
        model(input_ids=input_ids, labels=input_ids).loss.backward()

    return peak_of(step, model)
