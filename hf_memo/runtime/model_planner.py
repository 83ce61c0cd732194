"""How the memo runtime gets a memory plan for a patched model, without importing the layer that makes it.

Planning a patched model's step profiles a fake-tensor copy of it, patched again: that is integration work,
above the patches and the runtime (``hf_memo.integrations.planning``). The runtime only needs to call it, so the
integration registers its planner here when it is imported (importing any part of ``hf_memo`` imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hf_memo.planner.plan import MemoryPlan

ModelPlanner = Callable[..., MemoryPlan]
"""``planner(model, batch_size, seq_len, progress=..., offload=...)`` -> the memory plan of one training step."""

_registered: list[ModelPlanner] = []


def register_model_planner(planner: ModelPlanner) -> None:
    """Make ``planner`` the one :func:`plan_patched_model` calls."""
    _registered[:] = [planner]


def plan_patched_model(model: nn.Module, batch_size: int, seq_len: int, **options: Any) -> MemoryPlan:
    """The memory plan of a training step of ``model`` (patched by ``hf_memo.apply``) on ``(batch_size, seq_len)``
    token batches, by the registered planner (``progress`` off unless ``options`` say otherwise)."""
    if not _registered:
        raise RuntimeError("no memory planner is registered: import hf_memo.integrations.planning")
    return _registered[0](model, batch_size, seq_len, **{"progress": False, **options})
