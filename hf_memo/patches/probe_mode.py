"""Whether a module trains, as hf_memo's installed forwards ask it: in training mode, or inside a self-check probe.

The self-check (:mod:`hf_memo.patches.self_check`) runs the model with every module in eval mode, so that no
dropout draws and the patched and unpatched runs compute the same function, while hf_memo's forwards still take
their training paths (mini-sequence loss, recomputation, the memo executor). A plain attribute rather than a
context variable, so ``torch.compile`` guards on it like on ``module.training``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


class _Probe:
    active = False


def trains(module: nn.Module) -> bool:
    """Whether ``module`` runs hf_memo's training path: it is in training mode, or a self-check probe runs."""
    return module.training or _Probe.active


@contextlib.contextmanager
def probing(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` in eval mode (no dropout) and :func:`trains` true inside; afterwards each module is
    in its own mode again."""
    modes = {m: m.training for m in model.modules()}
    previous = _Probe.active
    model.eval()
    _Probe.active = True
    try:
        yield
    finally:
        _Probe.active = previous
        for module, training in modes.items():
            module.training = training
