"""Any decoder layer cut around its attention for the memo executor, by running the layer's own code.

``project(x_rows, start, stop)`` runs the layer's forward on rows ``[start, stop)`` up to the moment its attention
module calls transformers' attention interface (or, where it never does, torch's ``scaled_dot_product_attention``
directly, as Falcon's does), and takes ``q (B, h, s, D)``, ``k, v (B, h_kv, s, D)`` and the call's keyword
arguments from that call (:class:`AttentionTraits`: scale, dropout, sliding window, soft-cap,
sinks): whatever the layer computes before attention (an input norm or none, q/k norms, partial or no RoPE,
fused projections) is the model's own code. ``finish(x_rows, o_rows, start)`` runs the layer's forward again on
those rows with its attention answered by ``o_rows`` ``(B, s, h*D)``, so the residual layout (pre-norm, sandwich and
post-norms, parallel attention and MLP, residual multipliers and dropout) and the MLP (dense or mixture of experts)
are the model's own code too. What the attention module does after the interface is either taken to be its output
projection (then the attention module is not run at all), or, where that is not what it does (a norm before the
projection, heads mixed per token), its own code runs on ``o_rows`` (its projections before the interface are then
computed again and discarded).

What the layer feeds its attention is found once per layer (:class:`Anatomy`, at its first memo step): where it is
a norm, ``finish`` may skip it. The cheapest finish that reproduces the layer's own forward (its eager attention, a
causal mask) on the step's first rows is kept; a layer no finish reproduces is refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from transformers import AttentionInterface
from transformers.utils.output_capturing import _active_collector

from hf_memo.parallel.attention import AttentionConfigView
from hf_memo.patches.structure import attention_of, mlp_of
from hf_memo.runtime.attention_traits import AttentionTraits, traits_of_call
from hf_memo.runtime.batch_layout import LAYOUT_KEYWORD
from hf_memo.runtime.executor import project_rows

_CAPTURE = "hf_memo_capture"
_ANSWER = "hf_memo_answer"
# Keyword arguments an attention module may hand the interface besides the traits and what the layer got.
_PASSED_THROUGH = {"position_ids", "cache_position", LAYOUT_KEYWORD}
_TRAIT_ARGUMENTS = {"dropout", "scaling", "sliding_window", "softcap", "s_aux", "is_causal"}
_OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "dense", "out_proj")
# Layer arguments that carry a bias of the attention scores by position (ALiBi: Falcon-RW, Bloom, MPT)
_SCORE_BIASES = ("alibi", "position_bias")
_PROBE_ROWS = 4


class _Captured(Exception):  # noqa: N818 (control flow, not an error)
    """Raised by the capturing interface: the attention call's ``q, k, v`` and keyword arguments."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, kwargs: dict) -> None:
        super().__init__("attention call captured")
        self.qkv, self.mask, self.kwargs = (query, key, value), mask, kwargs


@dataclass
class _Calls:
    """The attention calls of one pass through an attention module that calls the interface ``expected`` times
    with the same queries and keys (DiffLlama: once per half of its values), and the calls answered so far."""

    expected: int
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, dict]]
    answered: int = 0


# The pass under way: ``None`` where the attention module calls the interface once.
_calls: contextvars.ContextVar[_Calls | None] = contextvars.ContextVar("hf_memo_calls", default=None)


@contextlib.contextmanager
def _expecting(calls: int) -> Iterator[_Calls | None]:
    """Inside, the capturing and answering interfaces serve an attention module calling the interface ``calls``
    times per pass (``0``: not known yet, the answering interface counts them in what it yields)."""
    state = _Calls(calls, []) if calls != 1 else None
    token = _calls.set(state)
    try:
        yield state
    finally:
        _calls.reset(token)


def _capture(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any = None, **kwargs
):
    """Raises :class:`_Captured` with the call's ``q, k, v``; for an attention calling the interface several times
    with the same ``q, k`` (see :class:`_Calls`), at the last call, with the calls' values side by side
    ``(B, h_kv, s, calls * D_v)``, answering the calls before it with zeros."""
    calls = _calls.get()
    if calls is None:
        raise _Captured(query, key, value, attention_mask, kwargs)
    calls.seen.append((query, key, value, attention_mask, kwargs))
    if len(calls.seen) < calls.expected:
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    first = calls.seen[0]
    for q, k, _, mask, other in calls.seen[1:]:
        if q is not first[0] or k is not first[1] or mask is not first[3] or other.keys() != first[4].keys():
            raise ValueError(
                f"{type(module).__name__} calls the attention interface {calls.expected} times with other queries, "
                "keys or masks, where hf_memo's attention core computes one attention per layer"
            )
    values = torch.cat([v for _, _, v, _, _ in calls.seen], dim=-1)
    raise _Captured(first[0], first[1], values, first[3], first[4])


@functools.cache
def _register_capture() -> str:
    AttentionInterface.register(_CAPTURE, _capture)
    return _CAPTURE


# The attention output the answering interface returns: ``(B, s, h*D)``, or ``None`` for zeros of the call's shape.
_answer_rows: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("hf_memo_answer", default=None)


def _answer(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any = None, **kwargs
) -> tuple[torch.Tensor, None]:
    """An attention interface that answers ``(B, s, h, D_v)`` from :data:`_answer_rows` without computing anything:
    for an attention calling the interface several times (:class:`_Calls`), each call its own ``D_v`` of each head's
    ``calls * D_v``."""
    rows = _answer_rows.get()
    calls = _calls.get()
    if calls is not None:
        calls.answered += 1
    if rows is None:
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    heads = rows.unflatten(-1, (query.shape[1], -1))
    if calls is None:
        return heads, None
    width = value.shape[-1]
    return heads[..., (calls.answered - 1) * width : calls.answered * width], None


@functools.cache
def _register_answer() -> str:
    AttentionInterface.register(_ANSWER, _answer)
    return _ANSWER


@contextlib.contextmanager
def _answered(attn: nn.Module, rows: torch.Tensor | None) -> Iterator[None]:
    """Inside, ``attn``'s attention calls return ``rows`` ``(B, s, h*D)`` (``None``: zeros)."""
    token = _answer_rows.set(rows)
    try:
        with _implementation(attn, _register_answer()):
            yield
    finally:
        _answer_rows.reset(token)


class _TorchAttentionCall(TorchFunctionMode):
    """An attention module's direct call of torch's ``scaled_dot_product_attention`` in its own forward
    (``q (B, h, s, D)``, ``k, v (B, h_kv, s, D)`` -> ``(B, h, s, D_v)``), captured (:class:`_Captured`, its arguments
    in the attention interface's names) or answered from :data:`_answer_rows` ``(B, s, h*D_v)`` (zeros where
    ``None``) without computing anything. Any other function runs as it is."""

    def __init__(self, owner: nn.Module, capture: bool) -> None:
        super().__init__()
        self.owner, self.capture = owner, capture
        self.calls = 0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # only the attention module's own call: not transformers' SDPA interface (an interface caller run under the
        # "sdpa" name) nor anything else of the layer
        if func is not nn.functional.scaled_dot_product_attention or sys._getframe(1).f_locals.get("self") is not (
            self.owner
        ):
            return func(*args, **kwargs)
        self.calls += 1
        bound = _SDPA_SIGNATURE.bind(*args, **kwargs).arguments
        query, key, value = bound["query"], bound["key"], bound["value"]
        if self.capture:
            asked = {
                "scaling": bound.get("scale"),
                "dropout": bound.get("dropout_p", 0.0),
                "is_causal": bound.get("is_causal", False),
            }
            raise _Captured(query, key, value, bound.get("attn_mask"), asked)
        rows = _answer_rows.get()
        if rows is None:
            return query.new_zeros(*query.shape[:-1], value.shape[-1])
        return rows.unflatten(-1, (query.shape[1], -1)).transpose(1, 2)


def _sdpa_signature(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> None:
    """The arguments of ``torch.nn.functional.scaled_dot_product_attention``, by which a call of it is read."""


_SDPA_SIGNATURE = inspect.signature(_sdpa_signature)  # read once: a Falcon layer's split calls SDPA per chunk


@contextlib.contextmanager
def _attention_calls(attn: nn.Module, direct: bool, capture: bool, rows: torch.Tensor | None = None) -> Iterator[Any]:
    """Inside, ``attn``'s attention calls are captured (``capture``) or answered with ``rows`` ``(B, s, h*D)``: its
    calls of transformers' attention interface, or (``direct``) of torch's SDPA, which it then makes under the
    ``"sdpa"`` implementation's name it branches on. Yields what counts the calls (``None`` for the interface)."""
    if not direct:
        if capture:
            with _implementation(attn, _register_capture()):
                yield None
        else:
            with _answered(attn, rows):
                yield None
        return
    token = _answer_rows.set(rows)
    calls = _TorchAttentionCall(attn, capture)
    try:
        with _implementation(attn, "sdpa"), calls:
            yield calls
    finally:
        _answer_rows.reset(token)


@contextlib.contextmanager
def _instance_attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` inside; afterwards exactly what it was (an instance attribute or none)."""
    missing = object()
    previous = obj.__dict__.get(name, missing)
    obj.__dict__[name] = value
    try:
        yield
    finally:
        if previous is missing:
            del obj.__dict__[name]
        else:
            obj.__dict__[name] = previous


def _implementation(attn: nn.Module, name: str) -> contextlib.AbstractContextManager:
    """``attn`` dispatches to attention implementation ``name`` inside (its config seen through a view)."""
    return _instance_attribute(attn, "config", AttentionConfigView(attn.config, name))


@contextlib.contextmanager
def outputs_not_recorded() -> Iterator[None]:
    """transformers' output recording (router logits, attentions) sees nothing of a probe."""
    token = _active_collector.set(None)
    try:
        yield
    finally:
        _active_collector.reset(token)


def _parameters(layer: nn.Module) -> set[str]:
    """The names the layer's forward takes."""
    return set(inspect.signature(type(layer).forward).parameters)


def _traits(kwargs: dict, passed: set[str], head_dim: int, model_type: str) -> AttentionTraits:
    """The traits of an attention call with keyword arguments ``kwargs``; ``passed``: the names the layer takes."""
    unknown = set(kwargs) - _TRAIT_ARGUMENTS - _PASSED_THROUGH - passed
    if unknown:
        raise ValueError(
            f"hf_memo cannot run model_type {model_type!r} under recompute='memo': its attention asks the attention "
            f"interface for {', '.join(sorted(unknown))}, which hf_memo's attention does not compute"
        )
    if kwargs.get("is_causal") is False:
        raise ValueError(
            f"hf_memo cannot run model_type {model_type!r} under recompute='memo': its attention is not causal"
        )
    return traits_of_call(kwargs, head_dim)


@dataclass(frozen=True)
class Anatomy:
    """How one decoder layer feeds its attention, and the cheapest finish that reproduces it.

    Attributes:
        attention_input: the layer's child whose output the attention reads (its input norm), or ``None`` where the
            attention reads the layer's input itself (post-norm layers) or something found only deeper.
        skip_input: ``finish`` skips that child: nothing else in the layer reads its output (not a parallel MLP,
            not a residual taken after the norm).
        own_tail: ``finish`` runs the attention module's own code after the interface, not just its output
            projection.
        traits: the attention's traits in the mode of the step that found them.
        calls: how many times the attention module calls the interface, with the same queries and keys (each call's
            values side by side in ``v``; the finish answers each call its own).
        direct: the attention module calls torch's ``scaled_dot_product_attention`` itself, not the interface.
        outputs: the layer returns a tuple of this many entries, its hidden states first and ``None`` after them
            (Falcon's attention weights when none are asked for); 0: it returns its hidden states alone.
    """

    attention_input: nn.Module | None
    skip_input: bool
    own_tail: bool
    traits: AttentionTraits
    calls: int = 1
    direct: bool = False
    outputs: int = 0


class LayerArguments:
    """The decoder layer's call arguments for split calls: no mask (``None`` where the layer got one), no cache,
    positions cut to rows.

    ``position_embeddings`` (``(cos, sin)``, each ``(B, S, d)``, or one complex ``(B, S, d)`` table) and
    ``position_ids`` ``(B, S)`` hold one entry per row of the step; everything else is passed as the layer got it.
    """

    def __init__(self, arguments: dict[str, Any], length: int | None = None) -> None:
        self.length = length  # the step's positions: other tensors with a row per position ``(B, S, ...)`` are cut too
        self.arguments = {k: v for k, v in arguments.items() if k not in ("hidden_states", LAYOUT_KEYWORD)}
        if "attention_mask" in self.arguments:  # none: hf_memo's attention attends by the step's layout
            self.arguments["attention_mask"] = None
        for name in ("cache", "past_key_values", "past_key_value"):
            if name in self.arguments:
                self.arguments[name] = None
        if "use_cache" in self.arguments:
            self.arguments["use_cache"] = False

    def needing_gradient(self) -> list[str]:
        """The arguments that hold a tensor needing a gradient (e.g. Gemma 4's per-layer input, computed from
        trainable embeddings outside the layer): memo's layer function returns none for them."""
        return [
            name
            for name, value in self.arguments.items()
            if any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_leaves(value))
        ]

    def rows(self, start: int, stop: int) -> dict[str, Any]:
        out = dict(self.arguments)
        embeddings = out.get("position_embeddings")
        if isinstance(embeddings, tuple):
            out["position_embeddings"] = tuple(t[:, start:stop] for t in embeddings)
        elif isinstance(embeddings, torch.Tensor):  # one complex table (Llama 4, DeepSeek-V2), (B, S, d)
            out["position_embeddings"] = embeddings[:, start:stop]
        if isinstance(out.get("position_ids"), torch.Tensor):
            out["position_ids"] = out["position_ids"][..., start:stop]
        for name, value in out.items():  # e.g. a hybrid layer's mask for its state-space mixer, (B, S)
            per_position = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == self.length
            if per_position and name not in ("position_embeddings", "position_ids"):
                out[name] = value[:, start:stop]
        return out


class GenericSplit:
    """A decoder layer cut around attention through its own forward ``inner`` (see the module docstring).

    ``project``: ``(B, s, H) -> q (B, h, s, D), k, v (B, h_kv, s, D)``; ``finish``:
    ``(B, s, H), (B, s, h*D) -> (B, s, H)``; ``traits``: the layer's attention (scale, dropout of this call, window,
    soft-cap, sinks).
    """

    def __init__(self, layer: nn.Module, inner: Callable, arguments: LayerArguments, anatomy: Anatomy) -> None:
        self.layer, self.inner, self.arguments, self.anatomy = layer, inner, arguments, anatomy
        self.attn = attention_of(layer)
        self.traits = anatomy.traits
        self.output_projection = output_projection_of(self.attn)

    def project(self, x: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with _attention_calls(self.attn, self.anatomy.direct, capture=True), _expecting(self.anatomy.calls):
            try:
                self.inner(hidden_states=x, **self.arguments.rows(start, stop))
            except _Captured as captured:
                return captured.qkv
        raise ValueError(f"{type(self.layer).__name__}'s forward never called its attention")

    def _tail(self, o: torch.Tensor) -> torch.Tensor:
        """What the attention module does after the interface: its output projection, then residual dropout."""
        out = project_rows(self.output_projection, o)
        dropout = getattr(self.attn, "resid_dropout", None)
        if isinstance(dropout, nn.Module):
            return dropout(out)
        p = getattr(self.attn, "residual_dropout", 0.0)
        return nn.functional.dropout(out, p=p, training=self.attn.training) if p else out

    def finish(self, x: torch.Tensor, o: torch.Tensor, start: int) -> torch.Tensor:
        """The layer's output on rows ``[start, start + s)``: ``x (B, s, H)``, their attention output ``o (B, s, h*D)``
        -> ``(B, s, H)`` (or the layer's tuple)."""
        with contextlib.ExitStack() as stack:
            if self.anatomy.own_tail:
                stack.enter_context(_expecting(self.anatomy.calls))
                stack.enter_context(_attention_calls(self.attn, self.anatomy.direct, capture=False, rows=o))
                arguments = self.arguments.rows(start, start + x.shape[1])
            else:
                tail = self._tail(o)
                stack.enter_context(_instance_attribute(self.attn, "forward", lambda *a, **k: (tail, None)))
                arguments = self.arguments.arguments
            if self.anatomy.skip_input:
                stack.enter_context(_instance_attribute(self.anatomy.attention_input, "forward", lambda h, *a, **k: h))
            out = self.inner(hidden_states=x, **arguments)
        return out[0] if self.anatomy.outputs else out

    def kept(self) -> list[torch.Tensor]:
        embeddings = self.arguments.arguments.get("position_embeddings")
        tables = list(embeddings) if isinstance(embeddings, tuple) else [embeddings] if embeddings is not None else []
        return [*self.layer.parameters(), *self.layer.buffers(), *tables]


def output_projection_of(attn: nn.Module) -> nn.Module | None:
    """The attention module's output projection by its usual names, or ``None``."""
    return next((m for n in _OUTPUT_PROJECTIONS if isinstance(m := getattr(attn, n, None), nn.Module)), None)


def _candidates(attn: nn.Module, attention_input: nn.Module | None, read_by_mlp: bool) -> list[tuple[bool, bool]]:
    """The finishes to try, cheapest first: ``(skip_input, own_tail)``."""
    if output_projection_of(attn) is None:
        return [(False, True)]
    skipping = [(True, False)] if attention_input is not None and not read_by_mlp else []
    return [*skipping, (False, False), (False, True)]


def find_anatomy(
    layer: nn.Module, inner: Callable, arguments: LayerArguments, x: torch.Tensor, model_type: str
) -> Anatomy:
    """The layer's :class:`Anatomy`, from its forward on the first rows of ``x`` ``(B, S, H)``: what it feeds its
    attention, and the cheapest finish that :func:`check_split` finds equal to the layer's own forward there.

    Raises:
        ValueError: the attention builds its own mask or asks for what hf_memo does not compute, or no finish
            reproduces the layer.
    """
    attn = attention_of(layer)
    not_softmax = ValueError(
        f"hf_memo cannot run model_type {model_type!r} under recompute='memo': {type(attn).__name__} in "
        f"{type(layer).__name__} does not call transformers' attention interface or torch's "
        "scaled_dot_product_attention (it computes its attention in its own code, or it is a linear-attention or "
        "state-space mixer), and memo replaces those calls only; use recompute='none', 'full' or 'selective'"
    )
    bias = next((name for name in _SCORE_BIASES if isinstance(arguments.arguments.get(name), torch.Tensor)), None)
    if bias is not None:
        raise ValueError(
            f"hf_memo cannot run model_type {model_type!r} under recompute='memo': {type(layer).__name__} adds a "
            f"positional bias to its attention scores ({bias!r}, ALiBi), which hf_memo's attention core does not "
            "compute; use recompute='none', 'full' or 'selective'"
        )
    if not hasattr(attn, "config"):  # nothing to dispatch an attention implementation by
        raise not_softmax
    rows = x[:, :_PROBE_ROWS].detach()
    with torch.no_grad(), outputs_not_recorded(), rng_untouched(layer):
        captured, direct = _first_attention_call(layer, inner, arguments, rows, model_type)
        if captured is None:
            raise not_softmax
        if captured.mask is not None:  # the layer got none: it made one itself
            raise ValueError(
                f"hf_memo cannot run model_type {model_type!r} under recompute='memo': {type(attn).__name__} "
                "hands its attention function a mask it builds itself, which hf_memo's attention core does not "
                "apply; use recompute='none', 'full' or 'selective'"
            )
        passed = set(arguments.arguments) | _parameters(layer)
        traits = _traits(captured.kwargs, passed, captured.qkv[0].shape[-1], model_type)
        outputs: dict[int, tuple[nn.Module, Any]] = {}  # by id, each output kept alive so no id is reused
        seen: dict[str, Any] = {}

        def record_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen["input"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        def record_mlp_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen["mlp"] = args[0] if args else next(iter(kwargs.values()))

        def record_output(module: nn.Module, args: tuple, out: Any) -> None:
            outputs.setdefault(id(out), (module, out))

        handles = [child.register_forward_hook(record_output) for child in layer.children() if child is not attn]
        handles.append(attn.register_forward_pre_hook(record_input, with_kwargs=True))
        handles.append(mlp_of(layer).register_forward_pre_hook(record_mlp_input, with_kwargs=True))
        try:
            answering = _attention_calls(attn, direct, capture=False)
            with _expecting(0) as counted, answering as calls_made, eval_mode(layer):
                returned = inner(hidden_states=rows, **arguments.rows(0, rows.shape[1]))
        finally:
            for handle in handles:
                handle.remove()
    calls = max(counted.answered, 1)
    returns = len(returned) if isinstance(returned, tuple) else 0
    if any(extra is not None for extra in (returned[1:] if returns else ())):
        raise ValueError(
            f"hf_memo cannot run model_type {model_type!r} under recompute='memo': {type(layer).__name__} returns more "
            f"than its hidden states ({returns} outputs), which memo's executor does not compute; use "
            "recompute='none', 'full' or 'selective'"
        )
    if direct and calls_made.calls > 1:
        raise ValueError(
            f"hf_memo cannot run model_type {model_type!r} under recompute='memo': {type(attn).__name__} calls torch's "
            f"scaled_dot_product_attention {calls_made.calls} times per layer, where hf_memo's attention core computes "
            "one attention per layer; use recompute='none', 'full' or 'selective'"
        )
    source = seen["input"]
    attention_input = outputs[id(source)][0] if source is not rows and id(source) in outputs else None
    if _projection_mixes_rows(
        GenericSplit(layer, inner, arguments, Anatomy(None, False, False, traits, direct=direct, outputs=returns)), rows
    ):
        raise ValueError(
            f"hf_memo cannot run model_type {model_type!r} under recompute='memo': {type(layer).__name__} computes its "
            "attention's queries, keys and values from more than each token's own row (a state-space or "
            "convolution mixer before its attention), and memo projects the rows chunk by chunk; use "
            "recompute='none', 'full' or 'selective'"
        )
    worst = None
    candidates = _candidates(attn, attention_input, seen.get("mlp") is source) if calls == 1 else [(False, True)]
    for skip_input, own_tail in candidates:  # (several calls: only the module's own code combines them)
        anatomy = Anatomy(attention_input, skip_input, own_tail, traits, calls, direct, returns)
        worst = check_split(layer, inner, arguments, rows, anatomy)
        if worst <= split_tolerance(rows.dtype):
            return anatomy
    raise ValueError(
        f"hf_memo cannot run model_type {model_type!r} under recompute='memo': its decoder layer "
        f"{type(layer).__name__}, cut around its attention, differs from its own forward by {worst:.3g} "
        "(relative): it computes something hf_memo's split does not reproduce"
    )


def _first_attention_call(
    layer: nn.Module, inner: Callable, arguments: LayerArguments, rows: torch.Tensor, model_type: str
) -> tuple[_Captured | None, bool]:
    """The layer's first attention call on ``rows`` ``(B, n, H)``, captured, and whether the attention module made it
    to torch's SDPA directly; ``(None, False)`` where it calls neither (a mixer that is not softmax attention).

    The interface is tried first. A module that branches on the implementation's name (Falcon: ``== "sdpa"``)
    takes its own path under the capturing one's name; then its direct SDPA call is tried.

    Raises:
        ValueError: the layer fails on these rows alone in both ways.
    """
    errors: list[BaseException] = []
    for direct in (False, True):
        with _attention_calls(attention_of(layer), direct, capture=True):
            try:
                inner(hidden_states=rows, **arguments.rows(0, rows.shape[1]))
            except _Captured as captured:
                return captured.with_traceback(None), direct  # no frame cycle keeping the layer's tensors alive
            except (RuntimeError, TypeError, IndexError) as error:
                errors.append(error)
    if not errors:
        return None, False
    error = errors[0]
    raise ValueError(
        f"hf_memo cannot run model_type {model_type!r} under recompute='memo': {type(layer).__name__} fails on the "
        f"first rows of the sequence alone ({type(error).__name__}: {error}), and memo runs each layer on chunks of "
        "rows (a hybrid layer's state-space mixer, or inputs of the whole sequence); use recompute='none', 'full' or "
        "'selective'"
    ) from error


def _projection_mixes_rows(split: GenericSplit, rows: torch.Tensor) -> bool:
    """Whether the layer's ``q, k, v`` of ``rows`` ``(B, n, H)`` projected in two chunks of rows differ from them
    projected at once (or cannot be projected so): what the layer runs before its attention mixes tokens."""
    if is_fake(rows):
        return False
    n, half = rows.shape[1], rows.shape[1] // 2
    with torch.no_grad(), outputs_not_recorded(), eval_mode(split.layer):
        try:
            whole = split.project(rows, 0, n)
            first, second = split.project(rows[:, :half], 0, half), split.project(rows[:, half:], half, n)
        except (RuntimeError, TypeError, ValueError):
            return True
    tolerance = split_tolerance(rows.dtype)
    joined = [torch.cat([a, b], dim=2) for a, b in zip(first, second)]
    return not all(_relative_difference(got, want) <= tolerance for got, want in zip(joined, whole))


def _relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |got - expected|`` relative to ``expected``'s largest entry (at least 1); ``inf`` where the shapes
    differ."""
    if got.shape != expected.shape:
        return math.inf
    scale = expected.float().abs().max().clamp_min(1.0)
    return ((got.float() - expected.float()).abs().max() / scale).item()


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` and its children in eval mode inside (no dropout), and the random generators of the CPU and of
    ``module``'s CUDA device as they were afterwards (a kernel may draw a seed even without dropout): a probe leaves
    the step's random stream as it found it. Afterwards each module is in its own mode again."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with rng_untouched(module):
            yield
    finally:
        for m, training in modes.items():
            m.training = training


def rng_untouched(module: nn.Module) -> contextlib.AbstractContextManager:
    """The random generators of the CPU and of ``module``'s CUDA devices as they were, after the block: a probe in
    training mode (LoRA dropout in its projections) draws nothing from the step's random stream."""
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits) -> torch.Tensor:
    """Plain math: ``q (B, h, n, D)``, ``k, v (B, h_kv, n, D)`` -> ``(B, n, h*D)`` (the split's check only)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-1, -2)).to(dtype) * traits.scale
    if traits.softcap is not None:
        scores = torch.tanh(scores / traits.softcap) * traits.softcap
    n = q.shape[2]
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if traits.window is not None:
        allowed &= torch.ones_like(allowed).triu(1 - traits.window)
    scores = scores.masked_fill(~allowed, -math.inf)
    if traits.sinks is not None:
        sinks = traits.sinks.to(dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sinks], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = probs.to(v.dtype) @ v
    return out.transpose(1, 2).reshape(q.shape[0], n, -1)


def _causal_mask(n: int, window: int | None, like: torch.Tensor) -> torch.Tensor:
    allowed = torch.ones(n, n, dtype=torch.bool, device=like.device).tril()
    if window is not None:
        allowed &= torch.ones_like(allowed).triu(1 - window)
    mask = torch.zeros(n, n, dtype=like.dtype, device=like.device).masked_fill(~allowed, torch.finfo(like.dtype).min)
    return mask[None, None]


def split_tolerance(dtype: torch.dtype) -> float:
    """How far a split may differ from the layer's own forward, relative to the layer's output: transformers' eager
    attention takes its softmax in float32 whatever the dtype; a split that is not the layer's computation differs
    by the size of the layer's terms."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def check_split(
    layer: nn.Module, inner: Callable, arguments: LayerArguments, rows: torch.Tensor, anatomy: Anatomy
) -> float:
    """How far the split's ``finish(x, attention(project(x)))``, in two chunks of rows, is from the layer's own
    forward (eager attention, causal mask) on ``rows`` ``(B, n, H)``, in eval mode, relative to the output's size
    (``inf`` where the finish fails); ``0.0`` on fake tensors (the estimator's profiles), which carry no values."""
    if is_fake(rows):
        return 0.0
    attn = attention_of(layer)
    n = rows.shape[1]
    with torch.no_grad(), outputs_not_recorded(), eval_mode(layer):
        split = GenericSplit(layer, inner, arguments, replace(anatomy, traits=replace(anatomy.traits, dropout_p=0.0)))
        q, k, v = split.project(rows, 0, n)
        o = _reference_attention(q, k, v, split.traits)
        half = n // 2  # in two chunks of rows, as the executor runs it: a finish that mixes rows differs
        try:
            got = [split.finish(rows[:, a:b], o[:, a:b], a) for a, b in ((0, half), (half, n))]
        except (RuntimeError, TypeError, ValueError):  # a finish that does not fit this layer's code
            return math.inf
        got = torch.cat([g[0] if isinstance(g, tuple) else g for g in got], dim=1)
        with _implementation(attn, "eager"):
            mask = _causal_mask(n, split.traits.window, rows)
            expected = inner(hidden_states=rows, **{**arguments.rows(0, n), "attention_mask": mask})
    expected = expected[0] if isinstance(expected, tuple) else expected
    return _relative_difference(got, expected)


def split_layer(layer: nn.Module, x: torch.Tensor, **arguments: Any) -> GenericSplit:
    """The split of an unpatched decoder ``layer`` for a step with input ``x`` ``(B, S, H)`` and the layer's other
    ``arguments`` (e.g. ``position_embeddings``), its anatomy found (and checked) on ``x``."""
    layer_arguments = LayerArguments(arguments, x.shape[1])
    anatomy = find_anatomy(layer, layer.forward, layer_arguments, x, type(layer).__name__)
    return GenericSplit(layer, layer.forward, layer_arguments, anatomy)
