"""Hugging Face gradient checkpointing under a recompute mode of hf_memo: hf_memo's mode takes the layers over.

``gradient_checkpointing_enable()`` (or ``TrainingArguments(gradient_checkpointing=True)``, which TRL turns
on by default) sets a flag on every decoder layer, and transformers' ``GradientCheckpointingLayer`` then
wraps the layer's forward in the layer's checkpoint function. Under ``recompute="full"``, ``"selective"``
or ``"memo"`` hf_memo decides what each layer keeps, so it calls the layer's forward with that wrapper
switched off: no layer is checkpointed twice, the flag stays set and has no effect.

A checkpoint function of one's own set on a layer (not one of transformers' own, with or without its
``offload``) is respected in every mode: it decides what that layer keeps, and hf_memo's mode does not
checkpoint or manage that layer a second time (:meth:`HFCheckpointingTakeover.custom_checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_memo.config import MemoConfig

logger = logging.getLogger(__name__)


class HFCheckpointingTakeover:
    """Runs the decoder layers of one patched model past Hugging Face's checkpointing; logs that once (info)."""

    def __init__(self, config: MemoConfig) -> None:
        self.config = config
        self._logged = False
        self._yielded = False

    def log(self) -> None:
        """Say once that hf_memo's recompute mode replaces Hugging Face gradient checkpointing."""
        if not self._logged:
            self._logged = True
            logger.info(
                "Hugging Face gradient checkpointing is on: MemoConfig.recompute=%r recomputes the decoder layers "
                "instead (the model's gradient_checkpointing flag is left as is and has no effect on them)",
                self.config.recompute,
            )

    def call(self, layer: nn.Module, inner: Callable, *args: Any, **kwargs: Any) -> Any:
        """``inner(*args, **kwargs)``, the forward of ``layer``, without Hugging Face's checkpointing of it."""
        if not getattr(layer, "gradient_checkpointing", False):
            return inner(*args, **kwargs)
        self.log()
        layer.gradient_checkpointing = False
        try:
            return inner(*args, **kwargs)
        finally:
            layer.gradient_checkpointing = True

    def custom_checkpoint(self, layer: nn.Module) -> Callable | None:
        """The checkpoint function of ``layer`` if checkpointing is on and it is not transformers' default.

        transformers' default (``torch.utils.checkpoint`` with the user's keyword arguments) is replaced by
        ``recompute="full"``/``"selective"``'s own call. Any other function set on the layer (a wrapper of
        one's own, e.g. one that counts recomputations) is called in its place, as
        ``fn(layer_forward, hidden_states)``, and decides what the layer keeps (under ``recompute="memo"`` the
        layer then runs outside the memo executor, which says so once, as a warning).
        """
        if not (getattr(layer, "gradient_checkpointing", False) and layer.training):  # as transformers: training only
            return None
        self.log()
        function = getattr(layer, "_gradient_checkpointing_func", None)
        if function is None or _is_transformers_own(function):
            return None
        if self.config.recompute == "memo" and not self._yielded:
            self._yielded = True
            logger.warning(
                "a decoder layer (%s) has a checkpoint function of its own (%r): it decides what that layer keeps, "
                "and MemoConfig.recompute='memo' does not manage that layer",
                type(layer).__name__,
                function,
            )
        return function


def _is_transformers_own(function: Callable) -> bool:
    """Whether ``function`` is the checkpoint function ``activation_checkpointing_enable`` sets: ``checkpoint`` with
    the user's keyword arguments, or transformers' wrapper of it that offloads the saved tensors (``offload=True``)."""
    if not isinstance(function, partial):
        return False
    return function.func is checkpoint or getattr(function.func, "__module__", None) == "transformers.modeling_utils"
