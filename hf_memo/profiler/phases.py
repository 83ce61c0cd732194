"""Which phase of a training step is running: embedding, a decoder layer's forward or backward, head, optimizer.

Forward phases follow the decoder layers' forward hooks. A layer's backward starts when the gradient
of its output arrives and ends when the gradient of its input is computed (gradient hooks on those
tensors), so recomputation under activation checkpointing, which happens inside backward, belongs to
the backward phase of its layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

STAGES = ("other", "forward", "backward", "optimizer")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder layers of a Hugging Face causal LM (or a PEFT model wrapping one).

    It is the module list with ``num_hidden_layers`` entries of one class, found by structure so any
    family (``model.layers``, ``transformer.h``, ...) works.
    """
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "get_base_model"):
        config = model.get_base_model().config
    if config is None:
        raise ValueError(f"expected a Hugging Face model with a config, got {type(model).__name__}")
    count = config.get_text_config().num_hidden_layers
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) == count
            and len({type(layer) for layer in module}) == 1
            and any(True for _ in module[0].parameters())
        ):
            return module
    raise ValueError(f"found no list of {count} decoder layers in {type(model).__name__}")


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class PhaseTracker:
    """Knows the phase of the running step, as the trace format names it (``"layer 3 backward"``, ...).

    The step driver sets :attr:`stage` (``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"``);
    hooks on the decoder layers refine it. Use as a context manager around one step.
    """

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self.stage = "other"
        self._forward_layer: int | None = None
        self._forward_done = False
        self._backward_layer: int | None = None
        self._backward_done = False
        self._handles: list[Any] = []

    def phase(self) -> str:
        """The phase allocations made now belong to."""
        if self.stage == "optimizer":
            return "optimizer"
        if self.stage == "backward":
            if self._backward_done:
                return "embedding"
            return "head" if self._backward_layer is None else f"layer {self._backward_layer} backward"
        if self.stage == "forward":
            if self._forward_done:
                return "head"
            return "embedding" if self._forward_layer is None else f"layer {self._forward_layer} forward"
        return "other"

    def _pre_forward(self, index: int, args: Any, kwargs: Any) -> None:
        if in_backward() or self.stage != "forward":
            return
        self._forward_layer = index
        inputs = _grad_tensors((args, kwargs))
        if inputs:
            register_multi_grad_hook(inputs, lambda grads, i=index: self._end_backward(i), mode="any")

    def _post_forward(self, index: int, output: Any) -> None:
        if in_backward() or self.stage != "forward":
            return
        if index == len(self.layers) - 1:
            self._forward_done = True
        outputs = _grad_tensors(output)
        if outputs:
            register_multi_grad_hook(outputs, lambda grad, i=index: self._start_backward(i), mode="any")

    def _start_backward(self, index: int) -> None:
        self._backward_layer = index

    def _end_backward(self, index: int) -> None:
        if index == 0:
            self._backward_done = True

    def __enter__(self) -> PhaseTracker:
        for index, layer in enumerate(self.layers):
            self._handles.append(
                layer.register_forward_pre_hook(
                    lambda _m, args, kwargs, i=index: self._pre_forward(i, args, kwargs), with_kwargs=True
                )
            )
            self._handles.append(
                layer.register_forward_hook(lambda _m, _args, output, i=index: self._post_forward(i, output))
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
