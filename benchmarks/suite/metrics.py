"""MFU from a measured step, and folder names of devices.

Model FLOPs and the peaks of known GPUs come from :mod:`hf_memo.integrations.flops`, the count
``MemoCallback`` logs with, so the suite and a training run report the same MFU for the same step.
"""

from __future__ import annotations

import re


def device_slug(device_name: str) -> str:
    """A folder-name form of a device name: ``"NVIDIA H200"`` -> ``"h200"``, ``"cpu"`` -> ``"cpu"``."""
    name = re.sub(r"^nvidia\s+", "", device_name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def mfu(flops_per_step: float, step_seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over ``peak``; ``None`` without a peak (it is unknown)."""
    if peak is None or step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / peak
