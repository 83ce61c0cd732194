"""Model FLOPs, MFU and the accelerator's peak rate."""

from __future__ import annotations

import re

from torch import nn

# Dense bf16 matrix peak in FLOP/s by ``torch.cuda.get_device_name()``, from the vendor's datasheet.
PEAK_BF16_FLOPS = {"NVIDIA H200": 989e12}


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of ``device_name`` in FLOP/s, or ``None`` when it is not in :data:`PEAK_BF16_FLOPS`."""
    return PEAK_BF16_FLOPS.get(device_name)


def device_slug(device_name: str) -> str:
    """A folder-name form of a device name: ``"NVIDIA H200"`` -> ``"h200"``, ``"cpu"`` -> ``"cpu"``."""
    name = re.sub(r"^nvidia\s+", "", device_name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def matmul_parameters(model: nn.Module) -> int:
    """Parameters that take part in matrix products: all but the input embedding, the LM head counted once.

    A tied LM head shares the embedding's weight, so it is added back explicitly.
    """
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) in seen or param is embedding:
            continue
        seen.add(id(param))
        total += param.numel()
    if head is embedding:
        total += head.numel()
    return total


def model_flops(seq_len: int, params: int, layers: int, hidden: int, batch: int = 1) -> float:
    """FLOPs of one training step: ``batch * (6 * s * P + 6 * n * h * s**2)``.

    ``6 * s * P`` is forward (2) and backward (4) through the matrix parameters; ``6 * n * h * s**2``
    is causal attention (scores and values, half the square) forward and backward. Recomputation is
    not counted: it is overhead, not model work.
    """
    return batch * (6.0 * seq_len * params + 6.0 * layers * hidden * seq_len**2)


def mfu(flops_per_step: float, step_seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over ``peak``; ``None`` without a peak."""
    if peak is None or step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / peak


def flops_at(seq_len: int, ref_flops: float, ref_len: int, layers: int, hidden: int) -> float:
    """:func:`model_flops` at ``seq_len`` for the model whose step at ``ref_len`` was ``ref_flops`` (batch 1)."""
    params = (ref_flops - 6.0 * layers * hidden * ref_len**2) / (6.0 * ref_len)
    return model_flops(seq_len, round(params), layers, hidden)
