"""The MEMO layer executor: attention computed once, token-wise offload or recompute of everything else.

One decoder layer is split by its model family into three per-call pieces (a :class:`LayerSplit`):

* ``project(x_rows, start, stop)``: norm, q/k/v projections and RoPE for rows ``[start, stop)`` of the
  sequence, ``(B, s, H) -> q (B, h, s, D), k, v (B, h_kv, s, D)``;
* the attention core over the whole sequence (its backward is called directly);
* ``finish(x_rows, o_rows)``: o_proj, residual, norm, MLP, residual, ``(B, s, H), (B, s, h*D) -> (B, s, H)``
  (o_proj through :func:`project_rows`).

q, k and v are gathered into ``(B, S, h, D)`` memory (passed as ``(B, h, S, D)`` views), so the kernels
write the attention output in that order too and its rows ``(B, S, h * D)`` are a view of it: the
stash keeps one copy of the attention output, however many chunks read it.

What a layer keeps is its :class:`~hf_memo.planner.policy.LayerPolicy` (given through its stash): its
input and the attention output, softmax statistics and what replays the dropout mask (attention is
never recomputed), or its input only (``keep_attention=False``: backward rebuilds q, k and v and runs
the attention core's forward again, under the forward's CPU and CUDA RNG state (the CUDA kernels draw their
dropout mask from the generator's Philox seed and offset, so the mask is drawn again), before its backward; the
attention-output rows its offloaded tokens' o_proj saved are views of that recomputed output, so it keeps no
copy of them).

Everything but attention is per token, so the sequence is cut into mini-sequence chunks. The first
``alpha_chunks`` chunks ("offloaded tokens") build their autograd graph in forward with every saved
tensor moved into the layer's :class:`~hf_memo.runtime.stash.LayerStash`; the other chunks run
without a graph and are recomputed chunk by chunk in backward from the stashed layer input and
attention output (recomputed first if the layer keeps its input only). The stash goes to host memory
or stays on the device, as the layer's policy says.

``finish`` may also return side outputs with one row per token (a mixture-of-experts layer's router logits,
``(B * s, E)``): the layer function returns each for the whole sequence, ``(B * S, ...)`` in batch-major order,
after its output, and backward differentiates every chunk's side outputs together with its output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch.autograd.graph import get_gradient_edge

from hf_memo.minseq.grads import GradSum
from hf_memo.minseq.replay import ReplayState, autocast_cache_kept
from hf_memo.runtime.attention_core import AttentionStats
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.stash import LayerStash, RecomputedInBackward, stash_hooks


def project_rows(projection: Callable[[torch.Tensor], torch.Tensor], o: torch.Tensor) -> torch.Tensor:
    """``projection`` (o_proj) of attention-output rows ``o`` ``(B, s, h*D) -> (B, s, H)`` without copying them.

    The rows ``finish`` gets are views of the attention output; with several sequences they are not
    contiguous, and a matmul (or GPT-2's ``Conv1D``) would flatten them into a copy and save that copy
    for the weight gradient, beside the attention output. Each sequence's rows are contiguous, so
    they are projected one sequence at a time instead.
    """
    if o.is_contiguous():
        return projection(o)
    return torch.stack([projection(rows) for rows in o.unbind(0)])


class LayerSplit(Protocol):
    """A decoder layer cut around its attention core (see the module docstring)."""

    traits: AttentionTraits  # the layer's attention: scale, dropout of this call (0 outside training), window, ...

    def project(self, x: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``y_rows (B, s, H)``, or ``(y_rows, *side)``: side outputs with one row per token ``(B * s, ...)``,
        batch-major (a mixture-of-experts layer's router logits), the same count for every chunk."""
        ...

    def kept(self) -> list[torch.Tensor]:
        """Tensors that are never stashed: the layer's parameters and buffers, shared RoPE tables."""
        ...


class AttentionCore(Protocol):
    """Causal attention as a forward/backward pair on ``(B, h, S, D)`` tensors (see :mod:`.attention_core`).

    ``backward`` returns ``(dq, dk, dv, dsinks)``: ``dsinks`` is the ``(h,)`` gradient of ``traits.sinks``
    (``None`` without sinks), which the executor adds to that parameter's gradient.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traits: AttentionTraits
    ) -> tuple[torch.Tensor, AttentionStats]: ...

    def backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        stats: AttentionStats,
        traits: AttentionTraits,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class StashSource(Protocol):
    """Where layers get their stash and find the one below them (implemented by ``MemoRuntime``)."""

    def open_stash(self, index: int, device: torch.device) -> LayerStash: ...

    def sealed(self, index: int, stash: LayerStash) -> None: ...

    def backward_started(self, stash: LayerStash, device: torch.device) -> None:
        """The backward of ``stash``'s layer begins: prefetch the stash below it (same forward); the top layer
        frees the rounding buffers."""
        ...

    def backward_done(self, stash: LayerStash, device: torch.device) -> None:
        """The backward of ``stash``'s layer ended; after the lowest layer of its forward the prefetch buffers
        are free."""
        ...

    def attention_ran(self) -> None: ...


class _Source(torch.autograd.Function):
    """A graph input that holds no data: ``value`` seen by autograd as coming from a node of its own.

    Differentiating with that node's edge as input yields the gradient for ``value`` while the only
    references to its memory are the saved tensors of the graph, which the stash offloads.
    """

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise AssertionError("graph sources are inputs of autograd.grad, never traversed")


def _accumulate(grads: list, need_x: int, sums: GradSum, wanted: list[bool]) -> list:
    """Split ``autograd.grad`` results into the first ``need_x`` input grads and parameter grads (added to ``sums``)."""
    rest = iter(grads[need_x:])
    sums.add([next(rest) if w else None for w in wanted])
    return grads[:need_x]


def _add_sinks_grad(
    sums: GradSum, params: tuple[torch.Tensor, ...], sinks: torch.Tensor | None, dsinks: torch.Tensor | None
) -> None:
    """Add the attention core's ``dsinks`` ``(h,)`` to the gradient of the parameter ``sinks`` is (by identity).

    Raises:
        RuntimeError: sinks that need a gradient are none of the layer's parameters (e.g. a gathered copy of one):
            their gradient would be lost.
    """
    if dsinks is None:
        return
    if not any(p is sinks for p in params):
        if sinks.requires_grad:
            raise RuntimeError(
                "the layer's attention sinks need a gradient but are none of its parameters (a copy of the "
                "parameter reached the attention call): recompute='memo' cannot return their gradient"
            )
        return
    sums.add([dsinks if p is sinks else None for p in params])


def _rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t[:, start:stop]


def _finished(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``finish``'s result as ``(y_rows (B, s, H), side outputs (B * s, ...))``."""
    return (out, ()) if isinstance(out, torch.Tensor) else (out[0], tuple(out[1:]))


def _chunk_outputs(
    y: Any,
    sides: list[Any],
    grad_y: torch.Tensor | None,
    grad_sides: tuple[torch.Tensor | None, ...],
    batch: int,
    start: int,
    stop: int,
) -> tuple[list[Any], list[torch.Tensor]]:
    """What one chunk differentiates: its output ``y`` (a tensor or gradient edge) and each differentiable side
    output (``None`` where not), with their rows of the gradients of the layer's outputs, ``grad_y`` ``(B, S, H)``
    and ``grad_sides`` ``(B * S, ...)`` each; an output whose gradient is ``None`` (nothing read it) is left out."""
    outputs, upstream = ([y], [_rows(grad_y, start, stop)]) if grad_y is not None else ([], [])
    for side, grad in zip(sides, grad_sides):
        if side is not None and grad is not None:
            outputs.append(side)
            upstream.append(_rows(grad.unflatten(0, (batch, -1)), start, stop).flatten(0, 1))
    return outputs, upstream


def _gather_heads(parts: list[torch.Tensor]) -> torch.Tensor:
    """Chunks ``(B, h, s_i, D)`` -> ``(B, h, S, D)``, a view of ``(B, S, h, D)`` memory (one copy)."""
    return torch.cat([t.transpose(1, 2) for t in parts], dim=1).transpose(1, 2)


def _sequence_major(out: torch.Tensor) -> torch.Tensor:
    """``out`` ``(B, h, S, D)`` as a view of ``(B, S, h, D)`` memory: itself when it is one (the local kernels),
    else one relaid copy (e.g. after a sequence-parallel exchange), so only that copy is kept."""
    if out.transpose(1, 2).is_contiguous():
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _rebuild_qkv(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``(B, h, S, D)``, k, v ``(B, h_kv, S, D)`` of the layer's forward: the offloaded chunks' from the stash,
    the others projected again from ``x`` ``(B, S, H)`` under their forward's RNG and autocast state."""
    qkv: list[list[torch.Tensor]] = [[], [], []]
    for refs in ctx.qkv_refs:
        for parts, ref in zip(qkv, refs):
            parts.append(ctx.stash.rebuild(ref))
    for (start, stop), replay in zip(ctx.bounds[ctx.alpha_chunks :], ctx.pre_replays):
        with torch.no_grad(), replay.replay():
            for parts, t in zip(qkv, ctx.split.project(_rows(x, start, stop), start, stop)):
                parts.append(t)
    q, k, v = (_gather_heads(parts) for parts in qkv)
    return q, k, v


class MemoLayerFunction(torch.autograd.Function):
    """One decoder layer under the memo executor; parameters are inputs and get their gradients from here."""

    @staticmethod
    def forward(
        ctx,
        runtime: StashSource,
        split: LayerSplit,
        core: AttentionCore,
        index: int,
        bounds: list[tuple[int, int]],
        alpha_chunks: int,
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        stash = runtime.open_stash(index, x.device)
        keep_attention = stash.keep_attention
        hooks = stash_hooks(stash, split.kept(), stash_them=False)
        anchor = torch.zeros((), device=x.device, requires_grad=True)
        offloaded, recomputed = bounds[:alpha_chunks], bounds[alpha_chunks:]
        x = x.detach()  # rows are read through graph sources or without autograd, never through x's graph
        ctx.x_ref = stash.add(x)

        qkv: list[list[torch.Tensor]] = [[], [], []]
        ctx.pre_graphs, ctx.pre_replays, ctx.qkv_refs = [], [], []
        with torch.enable_grad(), hooks:
            for start, stop in offloaded:
                x_in = _Source.apply(anchor, _rows(x, start, stop))
                outputs = split.project(x_in, start, stop)
                ctx.pre_graphs.append((get_gradient_edge(x_in), [get_gradient_edge(t) for t in outputs]))
                for parts, t in zip(qkv, outputs):
                    parts.append(t.detach())
        with torch.no_grad():
            for start, stop in recomputed:
                ctx.pre_replays.append(ReplayState.capture(x.device))
                for parts, t in zip(qkv, split.project(_rows(x, start, stop), start, stop)):
                    parts.append(t)
        ctx.qkv_refs = [[stash.add(parts[i]) for parts in qkv] for i in range(len(offloaded))]
        q, k, v = (_gather_heads(parts) for parts in qkv)
        del qkv
        ctx.attention_replay = None if keep_attention else ReplayState.capture(x.device)
        out, stats = core.forward(q, k, v, split.traits)
        runtime.attention_ran()
        del q, k, v
        out = _sequence_major(out)
        if keep_attention:
            ctx.o_ref, ctx.lse_ref, ctx.stats = stash.add(out), stash.add(stats.lse), replace(stats, lse=None)
            ctx.recomputed_out, post_hooks = None, hooks
        else:  # o_proj saves attention-output rows: rebuilt from the attention backward computes again
            ctx.recomputed_out = RecomputedInBackward(out)
            post_hooks = stash_hooks(stash, split.kept(), stash_them=False, recomputed=ctx.recomputed_out)
        o_rows = out.transpose(1, 2).reshape(*x.shape[:2], -1)  # a view: out is (B, S, h, D) in memory

        y, sides = None, []
        ctx.post_graphs, ctx.post_replays = [], []
        for chunk, (start, stop) in enumerate(bounds):
            if chunk < len(offloaded):
                with torch.enable_grad(), post_hooks:
                    x_in = _Source.apply(anchor, _rows(x, start, stop))
                    o_in = _Source.apply(anchor, _rows(o_rows, start, stop))
                    y_rows, side = _finished(split.finish(x_in, o_in))
                    side_edges = [get_gradient_edge(t) if t.requires_grad else None for t in side]
                    ctx.post_graphs.append(
                        (get_gradient_edge(x_in), get_gradient_edge(o_in), get_gradient_edge(y_rows), side_edges)
                    )
                    y_rows, side = y_rows.detach(), [t.detach() for t in side]
            else:
                ctx.post_replays.append(ReplayState.capture(x.device))
                with torch.no_grad():
                    y_rows, side = _finished(split.finish(_rows(x, start, stop), _rows(o_rows, start, stop)))
            if y is None:
                y = y_rows.new_empty((*x.shape[:2], y_rows.shape[-1]))
                sides = [t.new_empty((*x.shape[:2], *t.shape[1:])) for t in side]
            y[:, start:stop] = y_rows
            for full, t in zip(sides, side):
                full[:, start:stop] = t.unflatten(0, (x.shape[0], -1))
        del out, o_rows, stats
        stash.seal()
        runtime.sealed(index, stash)
        ctx.runtime, ctx.split, ctx.core, ctx.index, ctx.bounds, ctx.stash = runtime, split, core, index, bounds, stash
        ctx.alpha_chunks, ctx.keep_attention = alpha_chunks, keep_attention
        ctx.save_for_backward(*params)
        ctx.set_materialize_grads(False)  # an output nothing read (the aux loss alone, unused logits) costs nothing
        return (y, *(t.flatten(0, 1) for t in sides)) if sides else y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor | None, *grad_sides: torch.Tensor | None):
        device = next(g.device for g in (grad_y, *grad_sides) if g is not None)
        with autocast_cache_kept(device):  # each weight cast once, not once per recomputed chunk
            return MemoLayerFunction._backward(ctx, device, grad_y, grad_sides)

    @staticmethod
    def _backward(
        ctx, device: torch.device, grad_y: torch.Tensor | None, grad_sides: tuple[torch.Tensor | None, ...]
    ) -> tuple:
        stash: LayerStash = ctx.stash
        split: LayerSplit = ctx.split
        params = ctx.saved_tensors
        # retain_graph=True: everything the layer keeps stays for the next backward through this graph
        keep = torch._C._autograd._get_current_graph_task_keep_graph()
        ctx.runtime.backward_started(stash, device)
        wanted = list(ctx.needs_input_grad[7:])
        wanted_params = [p for p, w in zip(params, wanted) if w]
        sums = GradSum(params, wanted)
        x = stash.rebuild(ctx.x_ref)
        if ctx.keep_attention:
            q = k = v = None
            out, stats = stash.rebuild(ctx.o_ref), replace(ctx.stats, lse=stash.rebuild(ctx.lse_ref))
        else:
            q, k, v = _rebuild_qkv(ctx, x)
            with torch.no_grad(), ctx.attention_replay.replay():
                out, stats = ctx.core.forward(q, k, v, split.traits)
            ctx.runtime.attention_ran()
            out = ctx.recomputed_out.value = _sequence_major(out)
        o_rows = out.transpose(1, 2).reshape(*x.shape[:2], -1)
        grad_x = torch.empty_like(x)
        grad_o = torch.empty_like(o_rows)
        offloaded, recomputed = ctx.bounds[: ctx.alpha_chunks], ctx.bounds[ctx.alpha_chunks :]

        for (start, stop), (x_edge, o_edge, y_edge, side_edges) in zip(offloaded, ctx.post_graphs):
            outputs, upstream = _chunk_outputs(y_edge, side_edges, grad_y, grad_sides, x.shape[0], start, stop)
            grads = torch.autograd.grad(
                outputs, [x_edge, o_edge, *wanted_params], upstream, retain_graph=keep, allow_unused=True
            )
            grad_x[:, start:stop], grad_o[:, start:stop] = _accumulate(list(grads), 2, sums, wanted)
        for (start, stop), replay in zip(recomputed, ctx.post_replays):
            x_rows = _rows(x, start, stop).detach().requires_grad_(True)
            o_in = _rows(o_rows, start, stop).detach().requires_grad_(True)
            with torch.enable_grad(), replay.replay():
                y_rows, side = _finished(split.finish(x_rows, o_in))
            side = [t if t.requires_grad else None for t in side]
            outputs, upstream = _chunk_outputs(y_rows, side, grad_y, grad_sides, x.shape[0], start, stop)
            grads = torch.autograd.grad(outputs, [x_rows, o_in, *wanted_params], upstream, allow_unused=True)
            grad_x[:, start:stop], grad_o[:, start:stop] = _accumulate(list(grads), 2, sums, wanted)

        if q is None:
            q, k, v = _rebuild_qkv(ctx, x)
        grad_out = grad_o.view(*grad_o.shape[:2], q.shape[1], -1).transpose(1, 2)
        dq, dk, dv, dsinks = ctx.core.backward(grad_out, q, k, v, out, stats, split.traits)
        _add_sinks_grad(sums, params, split.traits.sinks, dsinks)
        del q, k, v, grad_o, grad_out, out, o_rows

        for (start, stop), (x_edge, edges) in zip(offloaded, ctx.pre_graphs):
            grads = torch.autograd.grad(
                edges,
                [x_edge, *wanted_params],
                [t[:, :, start:stop] for t in (dq, dk, dv)],
                retain_graph=keep,
                allow_unused=True,
            )
            (grad_pre,) = _accumulate(list(grads), 1, sums, wanted)
            grad_x[:, start:stop] += grad_pre
        for (start, stop), replay in zip(recomputed, ctx.pre_replays):
            x_rows = _rows(x, start, stop).detach().requires_grad_(True)
            with torch.enable_grad(), replay.replay():
                outputs = split.project(x_rows, start, stop)
            grads = torch.autograd.grad(
                outputs, [x_rows, *wanted_params], [t[:, :, start:stop] for t in (dq, dk, dv)], allow_unused=True
            )
            (grad_pre,) = _accumulate(list(grads), 1, sums, wanted)
            grad_x[:, start:stop] += grad_pre
        stash.release(keep)
        ctx.runtime.backward_done(stash, device)
        if ctx.recomputed_out is not None:
            ctx.recomputed_out.value = None
        if not keep:
            ctx.post_graphs = ctx.pre_graphs = ctx.stash = ctx.recomputed_out = None
        return (None, None, None, None, None, None, grad_x, *sums.result())
