"""DeepSpeed ZeRO stage 3: each region hf_memo computes is gathered whole, once for forward and once for backward.

ZeRO-3 keeps every parameter as a shape ``[0]`` placeholder outside the call of the module that owns it, and
gathers it around that call with module hooks (pre-forward, post-forward, and their backward twins). hf_memo's
autograd functions take parameters as inputs and recompute with them in backward, and they call submodules
many times per step (once per mini-sequence chunk, again for recomputation). So hf_memo hands DeepSpeed one
call that spans each region and owns every parameter the region uses:

* a decoder layer: every parameter below it is registered as an *external parameter* of the layer
  (``deepspeed.zero.register_external_parameter``), so the layer's own hooks gather all of them in one
  all-gather before its forward, release them after it, gather them again before its backward (which holds
  the recomputation and every chunk) and release them once its input gradient is out; the calls of its
  submodules inside find them present and gather nothing;
* the LM head and loss: the final norm's parameters are registered as external parameters of the LM head,
  and the whole mini-sequence loss runs inside a single call of the LM head module (:class:`HeadRegion`).

Gradients reach DeepSpeed as with any module: each parameter's gradient is returned once per backward by
hf_memo's autograd function (summed over chunks), and ZeRO-3's per-parameter hook reduce-scatters it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def is_partitioned(module: nn.Module) -> bool:
    """Whether ZeRO-3 has partitioned ``module``'s parameters (DeepSpeed gives each one a ``ds_id``)."""
    first = next(module.parameters(), None)
    return first is not None and hasattr(first, "ds_id")


def zero3_expected(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO stage 3 is, or is configured to be, in charge of ``model``'s parameters.

    Seen in the parameters (``deepspeed.zero.Init``, ``from_pretrained`` under a ZeRO-3 config), in
    transformers' DeepSpeed config (``TrainingArguments(deepspeed=...)``, Accelerate's DeepSpeed plugin), in the
    environment ``accelerate launch`` sets for a DeepSpeed config, or in a DeepSpeed already imported.
    """
    if is_partitioned(model):
        return True
    launched = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if launched and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
        return True
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


class Zero3Regions:
    """The regions of one patched model and the external-parameter registrations that make each one ZeRO-3 gather.

    ``regions`` maps an owner module (a decoder layer, the LM head) to the modules whose parameters its call
    uses. Registering is idempotent and imports DeepSpeed only once ZeRO-3 is expected; :meth:`undo` removes
    exactly what was registered. ``head`` is the LM head module the loss region runs in (see :meth:`loss`).
    """

    def __init__(self, regions: list[tuple[nn.Module, list[nn.Module]]], head: nn.Module) -> None:
        self.regions = regions
        self.head = head
        self.head_region = HeadRegion()
        self._registered: list[tuple[nn.Module, nn.Parameter]] = []

    @property
    def bound(self) -> bool:
        """Whether the registrations are in place."""
        return bool(self._registered)

    def ensure(self) -> None:
        """Register each region's parameters with its owner, once."""
        if self._registered:
            return
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        for owner, members in self.regions:
            for param in _external_to(owner, members):
                register_external_parameter(owner, param)
                self._registered.append((owner, param))

    def undo(self) -> None:
        """Remove the registrations made by :meth:`ensure`."""
        if not self._registered:
            return
        from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter

        for owner, param in self._registered:
            if id(param) in getattr(owner, "_external_params", {}):  # (a deep copy's registry keeps the old ids)
                unregister_external_parameter(owner, param)
        self._registered = []

    def loss(
        self, head: nn.Module, hidden: torch.Tensor, compute: Callable[[Callable, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``compute(head_forward, hidden)``: the LM head region (``hidden`` ``(B, S, H)``, a scalar back).

        Without ZeRO-3, ``compute`` gets ``head`` itself. Under ZeRO-3 it runs inside one call of ``head``.

        Raises:
            ValueError: under ZeRO-3, ``head`` is not the module hf_memo patched (the LM head was replaced after
                ``hf_memo.apply``, e.g. by PEFT targeting it).
        """
        if not is_partitioned(head):
            return compute(head, hidden)
        if head is not self.head:
            raise ValueError(
                f"under DeepSpeed ZeRO-3 hf_memo runs the loss inside the LM head's call, but the model's output "
                f"embeddings are now a {type(head).__name__} that hf_memo did not patch (replaced after "
                "hf_memo.apply, e.g. by PEFT): call hf_memo.apply on the final model (after get_peft_model)"
            )
        self.ensure()
        return self.head_region.run(head, hidden, compute)


def _external_to(owner: nn.Module, members: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Parameters of ``members`` (recursively) that ZeRO-3 would not gather in ``owner``'s own call, in order."""
    own = {id(p) for p in owner.parameters(recurse=False)}
    seen, found = set(own), []
    for module in members:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                found.append(param)
    return found


class HeadRegion:
    """Runs the mini-sequence LM head and loss inside one call of the LM head module.

    :meth:`run` calls ``head(hidden)``; the forward hf_memo installed on the head (:func:`head_forward`) sees the
    pending computation and runs it instead of the head's own forward, handing it the head's forward (without
    module hooks) and ``hidden`` as ZeRO-3's hooks passed it on (they attach its backward release to it).
    """

    def __init__(self) -> None:
        self.pending: Callable[[Callable, torch.Tensor], torch.Tensor] | None = None

    def run(
        self, head: nn.Module, hidden: torch.Tensor, compute: Callable[[Callable, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``compute(head_forward, hidden)`` inside ``head``'s call.

        Args:
            head: the LM head module, with :func:`head_forward` installed.
            hidden: ``(B, S, H)`` (or ``(N, H)``) final hidden states.
            compute: the region, e.g. the mini-sequence loss; returns a scalar.
        """
        self.pending = compute
        try:
            return head(hidden)
        finally:
            self.pending = None


def head_forward(region: HeadRegion, module: nn.Module, inner: Callable, *args: Any, **kwargs: Any) -> Any:
    """The LM head's forward: the pending region of ``region`` if there is one, else the head's own forward."""
    compute = region.pending
    if compute is None:
        return inner(*args, **kwargs)
    region.pending = None
    return compute(inner, args[0])
