"""How the memo runtime sizes a memory policy by its own profile, without importing the layer that profiles it.

A policy's device bytes are read off fake-tensor profiles of a copy of the patched model running that policy
(``hf_memo.integrations.policy_sizing``): integration work, above the runtime. The integration registers its sizer
here when it is imported (importing any part of ``hf_memo`` imports it), like the memory planner
(:mod:`.model_planner`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from hf_memo.planner.policy import MemoryPolicy

PolicySizer = Callable[[nn.Module, int, int, MemoryPolicy], int]
"""``sizer(model, batch_size, seq_len, policy)`` -> the device bytes a step of that shape holds at its peak beyond the
model's parameters, buffers, gradients and optimizer state."""

_registered: list[PolicySizer] = []


def register_policy_sizer(sizer: PolicySizer) -> None:
    """Make ``sizer`` the one :func:`size_policy` calls."""
    _registered[:] = [sizer]


def size_policy(model: nn.Module, batch_size: int, seq_len: int, policy: MemoryPolicy) -> int:
    """The step's device bytes beyond the model states under ``policy`` (see :data:`PolicySizer`)."""
    if not _registered:
        raise RuntimeError("no policy sizer is registered: import hf_memo.integrations.policy_sizing")
    return _registered[0](model, batch_size, seq_len, policy)
