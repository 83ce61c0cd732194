"""Mixture-of-experts router logits: which modules route, their logits with gradient in every mode, the aux loss.

transformers records router logits with forward hooks on the router modules its backbone class names in
``_can_record_outputs["router_logits"]``; the hooks append to the collector that the backbone's forward sets while
``output_router_logits`` is on, and the causal LM adds ``router_aux_loss_coef * load_balancing_loss_func(...)`` of
what they collected to its loss. hf_memo runs the MLP (and, under the memo executor, the rest of the layer after
attention) in chunks, and the chunks of a training forward run without autograd: left alone, the hooks would
collect one entry per chunk, without gradient.

Decision: transformers' collector stays the one place router logits are collected, and it sees exactly what it
would see without hf_memo: one ``(B * S, E)`` entry per router call of a layer, in transformers' (batch-major) row
order, with gradient. While a chunk runs, the hooks record into a collector of the chunk's own
(:func:`router_logits_captured`); the chunked autograd function returns the chunks' logits, concatenated, as
differentiable outputs beside the hidden states (their gradients go into each chunk's backward with the hidden
states'), and that one tensor is appended to transformers' collection (:func:`record_router_logits`). Every
forward that collects router logits therefore gets them right, through hf_memo's loss or through transformers'
own forward (a training forward without labels, a trainer's own head), and nothing else needs to know about
chunks. The hooks and the collector are transformers' (``transformers.utils.output_capturing``), so the routers,
the output index and the ``layer_name`` filters are exactly the ones transformers applies.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils.output_capturing import OutputRecorder, _active_collector

_KEY = "router_logits"


def router_recorders(model: nn.Module) -> list[OutputRecorder]:
    """How transformers records the router logits of ``model`` (a causal LM or its backbone): the recorders of
    the backbone class's ``_can_record_outputs["router_logits"]`` (router class, output index, optional layer
    name), an empty list for a dense model. A bare class there records its output 1, as transformers reads it."""
    backbone = getattr(model, model.base_model_prefix, model) if isinstance(model, PreTrainedModel) else model
    specs = (getattr(type(backbone), "_can_record_outputs", None) or {}).get(_KEY)
    if specs is None:
        return []
    recorders = []
    for spec in specs if isinstance(specs, list) else [specs]:
        if not isinstance(spec, OutputRecorder):
            spec = OutputRecorder(None, 1, class_name=spec) if isinstance(spec, str) else OutputRecorder(spec, 1)
        recorders.append(spec)
    return recorders


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The router modules of ``model`` whose logits transformers records, bottom to top; empty for a dense model.

    They are matched as transformers matches them (:func:`router_recorders`: the target class, or the module name's
    suffix, and the ``layer_name`` filter) over the backbone's modules.
    """
    recorders = router_recorders(model)
    backbone = getattr(model, model.base_model_prefix, model) if isinstance(model, PreTrainedModel) else model
    return [
        module
        for name, module in backbone.named_modules()
        if any(_matches(recorder, f".{name}" if name else "", module) for recorder in recorders)
    ]


def _matches(recorder: OutputRecorder, name: str, module: nn.Module) -> bool:
    by_class = recorder.target_class is not None and isinstance(module, recorder.target_class)
    by_name = recorder.class_name is not None and name.endswith(recorder.class_name)
    if not (by_class or by_name):
        return False
    return recorder.layer_name is None or f".{recorder.layer_name.strip('.')}." in name + "."


def recording_router_logits() -> bool:
    """Whether transformers is collecting router logits now (inside a backbone forward with
    ``output_router_logits`` on)."""
    collected = _active_collector.get()
    return collected is not None and _KEY in collected


@contextmanager
def router_logits_captured() -> Iterator[list[torch.Tensor]]:
    """Inside, the router logits transformers' hooks record go to the yielded list; afterwards the collection is as
    before. Where transformers is collecting, only the list under its router-logits key is swapped: setting a
    collector of one's own inside its capture is a second capture in a chain, which transformers refuses."""
    captured: list[torch.Tensor] = []
    collected = _active_collector.get()
    if collected is not None and _KEY in collected:
        previous, collected[_KEY] = collected[_KEY], captured
        try:
            yield captured
        finally:
            collected[_KEY] = previous
        return
    _active_collector.set({_KEY: captured})
    try:
        yield captured
    finally:
        _active_collector.set(collected)  # restored by value, so it nests under torch.compile too


def record_router_logits(logits: Sequence[torch.Tensor]) -> None:
    """Append ``logits`` (each ``(B * S, E)``, one per router call) to transformers' collection, as its hooks
    would have recorded them from an unchunked call."""
    collected = _active_collector.get()
    if collected is not None and _KEY in collected:
        collected[_KEY].extend(logits)


class RouterLogitsTap:
    """A module call that also returns the router logits recorded inside it (for the mini-sequence MLP).

    ``tap(x)`` returns the module's output as is when transformers is not collecting router logits as the tap is
    built; otherwise its outputs followed by the logits, each ``(n, E)`` for the ``n`` tokens of ``x``, which
    :func:`~hf_memo.minseq.mlp.minseq_mlp` concatenates as flat-row outputs. ``tap.recorded(full)`` takes that
    full-length result apart: the logits go to transformers' collection, the module's output is returned. The
    choice is made once, so a chunk recomputed in backward (no collection then) returns what it returned forward.
    """

    def __init__(self, module_call: Callable[[torch.Tensor], Any]) -> None:
        self.module_call = module_call
        self.keep = recording_router_logits()
        self.single, self.arity = True, 1

    def __call__(self, x: torch.Tensor) -> Any:
        if not self.keep:
            return self.module_call(x)
        with router_logits_captured() as logits:
            out = self.module_call(x)
        self.single = not isinstance(out, tuple)
        outputs = (out,) if self.single else tuple(out)
        self.arity = len(outputs)
        return (*outputs, *logits)

    def recorded(self, full: Any) -> Any:
        """The module's output from the (chunked) result of calls of this tap; the logits in it recorded."""
        if not self.keep:
            return full
        record_router_logits(full[self.arity :])
        return full[0] if self.single else full[: self.arity]


class RouterLogitsSplit:
    """A memo :class:`~hf_memo.runtime.executor.LayerSplit` whose ``finish`` also returns the router logits its rows
    recorded: ``(y (B, s, H), *logits (B * s, E))`` (just ``y`` where nothing routes or transformers is not
    collecting as the split is built); the executor returns them for the whole sequence in transformers' row order
    and differentiates them with ``y``. Everything else is the wrapped split's.
    """

    def __init__(self, split: Any) -> None:
        self.split = split
        self.keep = recording_router_logits()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.split, name)

    def finish(self, x: torch.Tensor, o: torch.Tensor, start: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if not self.keep:
            return self.split.finish(x, o, start)
        with router_logits_captured() as logits:
            y = self.split.finish(x, o, start)
        return (y, *logits) if logits else y

    @staticmethod
    def recorded(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The layer's output ``(B, S, H)`` from the executor's result; the router logits in it recorded."""
        if not isinstance(out, tuple):
            return out
        record_router_logits(out[1:])
        return out[0]


def wants_router_logits(model: PreTrainedModel, requested: bool | None) -> bool:
    """Whether a forward of ``model`` collects router logits and adds the aux loss: ``requested`` (the call's
    ``output_router_logits``) or else the config's, for a model with routers."""
    wanted = requested if requested is not None else getattr(model.config, "output_router_logits", False)
    return bool(wanted) and bool(router_modules(model)) and adds_router_aux_loss(model)


def adds_router_aux_loss(model: PreTrainedModel) -> bool:
    """Whether ``model``'s own forward adds a router load-balancing loss: its code calls ``load_balancing_loss_func``
    (DeepSeek-V2/V3, GLM-4-MoE and others have routers but no such loss, and ignore ``output_router_logits``)."""
    forward = inspect.unwrap(type(model).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and _LOSS_FUNC in code.co_names


def router_aux_loss(
    model: PreTrainedModel, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """The load-balancing loss transformers adds for ``model``: its modeling module's ``load_balancing_loss_func``
    over ``router_logits`` (one ``(B * S, E)`` per MoE layer) with the model's expert count and top-k and the
    ``(B, S)`` ``attention_mask`` the caller passed (``None``: every token counts). Not yet multiplied by
    :func:`router_aux_loss_coef`.

    Raises:
        ValueError: the modeling module defines no ``load_balancing_loss_func``.
    """
    # the first class up the hierarchy whose module defines it: FSDP2's fully_shard swaps in a subclass of its own
    modules = [sys.modules[cls.__module__] for cls in type(model).__mro__]
    loss_func = next((getattr(m, _LOSS_FUNC) for m in modules if hasattr(m, _LOSS_FUNC)), None)
    if loss_func is None:
        raise ValueError(
            f"hf_memo cannot add the router aux loss of {type(model).__name__}: no modeling module of its classes "
            "defines load_balancing_loss_func"
        )
    text = model.config.get_text_config()
    num_experts = getattr(model, "num_experts", None) or _first(text, ("num_experts", "num_local_experts"))
    top_k = getattr(model, "num_experts_per_tok", None) or _first(text, ("num_experts_per_tok", "top_k"))
    return loss_func(router_logits, num_experts, top_k, attention_mask)


def router_aux_loss_coef(model: PreTrainedModel) -> float:
    """The weight of the router aux loss in ``model``'s loss, under the model's own name for it:
    ``router_aux_loss_coef`` (JetMoe's config: ``aux_loss_coef``)."""
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is not None:
        return coef
    text = model.config.get_text_config()
    coef = _first(text, _COEFFICIENT_NAMES)
    if coef is None:
        raise ValueError(
            f"hf_memo cannot add the router aux loss of {type(model).__name__}: its config has none of "
            f"{', '.join(_COEFFICIENT_NAMES)}"
        )
    return coef


_LOSS_FUNC = "load_balancing_loss_func"
_COEFFICIENT_NAMES = ("router_aux_loss_coef", "aux_loss_coef")


def _first(config: Any, names: tuple[str, ...]) -> Any:
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
