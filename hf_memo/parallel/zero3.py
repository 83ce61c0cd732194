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

*Leaf modules* (``deepspeed.utils.set_z3_leaf_modules``; DeepSpeed makes Mixtral's, Qwen2-MoE's and Qwen3-MoE's
sparse MoE blocks leaves by default) have no per-parameter hook: DeepSpeed reduce-scatters all their parameters'
gradients in a full backward hook of the leaf module, which fires once per call of the module. Inside a region
hf_memo calls the module once per chunk (and the memo executor differentiates each chunk on its own), so the hook
would fire once per chunk, before hf_memo has returned the parameters' gradients. hf_memo therefore adopts the
hook (:meth:`Zero3Regions.ensure`, once DeepSpeed has set it): it is taken off the leaf module and runs once per
backward of the region's owner, after the owner's parameters have their gradients (:class:`_AfterRegionBackward`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

# The name of the full backward hook by which DeepSpeed's ZeRO-3 optimizer reduces a leaf module's gradients
# (``DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks``).
_LEAF_REDUCTION = "reduce_leaf_module_grads"


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
        # owner -> the leaf-module gradient reductions it runs: (leaf module, hook key, hook)
        self._adopted: dict[nn.Module, list[tuple[nn.Module, int, Callable]]] = {}
        self._owner_hooks: list[RemovableHandle] = []
        self._reducing = True

    @contextlib.contextmanager
    def reductions_paused(self) -> Iterator[None]:
        """Inside, no leaf reduction runs (hf_memo's self-check: its gradients are no step's): those DeepSpeed hooked
        are adopted first, and the adopted ones paused."""
        if is_partitioned(self.head):
            self.ensure()
        self._reducing = False
        try:
            yield
        finally:
            self._reducing = True

    @property
    def bound(self) -> bool:
        """Whether the registrations are in place."""
        return bool(self._registered)

    def ensure(self) -> None:
        """Register each region's parameters with its owner, once; adopt the gradient reductions of the leaf
        modules inside the regions that DeepSpeed has hooked since (see the module docstring)."""
        if not self._registered:
            from deepspeed.runtime.zero.partition_parameters import register_external_parameter

            for owner, members in self.regions:
                for param in _external_to(owner, members):
                    register_external_parameter(owner, param)
                    self._registered.append((owner, param))
        self._adopt_leaf_reductions()

    def undo(self) -> None:
        """Remove the registrations made by :meth:`ensure` and give the adopted reductions back to their modules."""
        for handle in self._owner_hooks:
            handle.remove()
        for reductions in self._adopted.values():
            for module, key, hook in reductions:
                module._backward_hooks[key] = hook
        self._owner_hooks, self._adopted = [], {}
        if not self._registered:
            return
        from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter

        for owner, param in self._registered:
            if id(param) in getattr(owner, "_external_params", {}):  # (a deep copy's registry keeps the old ids)
                unregister_external_parameter(owner, param)
        self._registered = []

    def _adopt_leaf_reductions(self) -> None:
        """Take DeepSpeed's gradient reduction hook off every leaf module inside a region (other than the owner,
        whose own hook fires once per call as it should), for the owner to run once per backward."""
        for owner, members in self.regions:
            for member in members:
                for module in member.modules():
                    if module is owner or not getattr(module, "_z3_leaf", False):
                        continue
                    for key, hook in list(module._backward_hooks.items()):
                        if getattr(hook, "__name__", None) == _LEAF_REDUCTION:
                            del module._backward_hooks[key]
                            if owner not in self._adopted:
                                self._adopted[owner] = []
                                self._owner_hooks.append(
                                    owner.register_forward_pre_hook(self._mark_input, with_kwargs=True)
                                )
                            self._adopted[owner].append((module, key, hook))

    def _mark_input(self, owner: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Before a training call of ``owner``: its hidden states (first argument) through
        :class:`_AfterRegionBackward`, so its backward runs the reductions ``owner`` adopted."""
        if not torch.is_grad_enabled() or not self._reducing:
            return None
        run = partial(_run_reductions, self._adopted[owner])
        if args and isinstance(args[0], torch.Tensor):
            x = args[0]
            anchor = torch.zeros((), device=x.device, requires_grad=True)
            return (_AfterRegionBackward.apply(run, anchor, x), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            x = kwargs["hidden_states"]
            anchor = torch.zeros((), device=x.device, requires_grad=True)
            return args, {**kwargs, "hidden_states": _AfterRegionBackward.apply(run, anchor, x)}
        raise ValueError(
            f"under DeepSpeed ZeRO-3 hf_memo marks the hidden states a {type(owner).__name__} is called with (its "
            "first argument, or hidden_states=), but this call passed none"
        )

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


def _run_reductions(reductions: list[tuple[nn.Module, int, Callable]]) -> None:
    """Run DeepSpeed's adopted leaf-module gradient reductions (they read the parameters' ``.grad``, not their
    arguments: a leaf parameter without a gradient is reduced as zeros)."""
    for module, _, hook in reductions:
        hook(module, (), ())


class _AfterRegionBackward(torch.autograd.Function):
    """The identity on a region owner's hidden states whose backward runs the owner's adopted leaf reductions.

    Its backward comes once the owner's backward has produced its input gradient: every parameter of the owner
    was used on a path from its hidden states, and the autograd engine runs a parameter's gradient accumulation
    as soon as it is ready, before any other node. ``anchor`` (a scalar that requires a gradient) makes the
    backward run even where the hidden states need none (the first layer below frozen embeddings).
    """

    @staticmethod
    def forward(ctx: Any, run: Callable[[], None], anchor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        ctx.run()
        return None, None, grad


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
