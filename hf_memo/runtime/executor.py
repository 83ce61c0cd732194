"""The MEMO layer executor: attention computed once, token-wise offload or recompute of everything else.

One decoder layer is split by its model family into three per-call pieces (a :class:`LayerSplit`):

* ``project(x_rows, start, stop)``: norm, q/k/v projections and RoPE for rows ``[start, stop)`` of the
  sequence, ``(B, s, H) -> q (B, h, s, D), k, v (B, h_kv, s, D)``;
* the attention core over the whole sequence (its backward is called directly);
* ``finish(x_rows, o_rows, start)``: o_proj, residual, norm, MLP, residual for rows ``[start, start + s)``,
  ``(B, s, H), (B, s, h*D) -> (B, s, H)`` (o_proj through :func:`project_rows`).

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
from hf_memo.profiler.placement import mark_part
from hf_memo.runtime.attention_core import AttentionStats, LocalAttention
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.blocked_attention import KeyGradSums, block_backward, block_forward, blockable
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

    def finish(self, x: torch.Tensor, o: torch.Tensor, start: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Rows ``[start, start + s)``: ``y_rows (B, s, H)``, or ``(y_rows, *side)``: side outputs with one row
        per token ``(B * s, ...)``, batch-major (a mixture-of-experts layer's router logits), the same count for
        every chunk."""
        ...

    def kept(self) -> list[torch.Tensor]:
        """Tensors that are never stashed: the layer's parameters and buffers, shared RoPE tables."""
        ...


class AttentionCore(Protocol):
    """Causal attention as a forward/backward pair on ``(B, h, S, D)`` tensors (see :mod:`.attention_core`).

    ``backward`` returns ``(dq, dk, dv, dsinks)``: ``dsinks`` is the ``(h,)`` gradient of ``traits.sinks``
    (``None`` without sinks), which the executor adds to that parameter's gradient. A core may also offer
    ``backward_releasing(tensors, stats, traits)``, the same on ``tensors = [grad_out, q, k, v, out]``, setting each
    entry to ``None`` once it no longer needs it (e.g. after an exchange): the executor then holds none of them.
    A core may also run a layer's backward attention one chunk of queries at a time over keys it holds for the whole
    backward: ``blocks_queries(length, traits)`` says whether it will for a layer of ``length`` positions, and
    ``query_blocks(heads, [k, v], lse, traits)`` returns its :class:`QueryBlocks`.
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


class QueryBlocks(Protocol):
    """A core's attention for one layer's backward, chunk by chunk of queries over keys held throughout (for a
    core that exchanges them, e.g. across a sequence-parallel group): the keys' gradients are final only after the
    last chunk. Rows are ``(B, h, stop - start, D)``, the chunk's positions, all heads."""

    def forward(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The chunk's attention output (its statistics kept for :meth:`backward`)."""
        ...

    def backward(
        self, grad_out: torch.Tensor, q: torch.Tensor, out: torch.Tensor, start: int, stop: int
    ) -> torch.Tensor:
        """The chunk's dq; its part of the keys' gradients is kept."""
        ...

    def key_grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(dk, dv, dsinks)`` after every chunk: ``(B, h_kv, S, D)`` each and the sinks' ``(h,)`` or ``None``."""
        ...


class StashSource(Protocol):
    """Where layers get their stash and find the one below them (implemented by ``MemoRuntime``)."""

    def open_stash(self, index: int, device: torch.device) -> LayerStash: ...

    def sealed(self, index: int, stash: LayerStash) -> None: ...

    def fetch_below(self, stash: LayerStash, nbytes: int | None) -> None:
        """The backward of ``stash``'s layer has given back ``nbytes`` device bytes so far: the stash below it (same
        forward) may fetch that many of its bytes now (``None``: all of them, ahead of its backward)."""
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


class _HeadRows:
    """q, k and v ``(B, h, S, D)`` of the whole sequence filled chunk by chunk, each a view of ``(B, S, h, D)``
    memory allocated when its first chunk arrives (no list of chunks concatenated: one copy, never two)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.tensors: list[torch.Tensor] = []

    def write(self, start: int, stop: int, parts: tuple[torch.Tensor, ...]) -> None:
        """Rows ``[start, stop)`` of each tensor from ``parts`` ``(B, h_i, stop - start, D_i)``."""
        if not self.tensors:
            self.tensors = [
                t.new_empty((t.shape[0], self.length, t.shape[1], t.shape[3])).transpose(1, 2) for t in parts
            ]
        for full, t in zip(self.tensors, parts):
            full[:, :, start:stop] = t


def _sequence_major(out: torch.Tensor) -> torch.Tensor:
    """``out`` ``(B, h, S, D)`` as a view of ``(B, S, h, D)`` memory: itself when it is one (the local kernels),
    else one relaid copy (e.g. after a sequence-parallel exchange), so only that copy is kept."""
    if out.transpose(1, 2).is_contiguous():
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _rebuild_qkv(ctx, x: torch.Tensor, keys_only: bool = False) -> list[torch.Tensor]:
    """q ``(B, h, S, D)``, k, v ``(B, h_kv, S, D)`` of the layer's forward (``keys_only``: k and v): the offloaded
    chunks' from the stash, the others projected again from ``x`` ``(B, S, H)`` under their forward's RNG and
    autocast state."""
    rows, first = _HeadRows(x.shape[1]), 1 if keys_only else 0
    for (start, stop), refs in zip(ctx.bounds, ctx.qkv_refs):
        rows.write(start, stop, tuple(ctx.stash.rebuild(ref) for ref in refs[first:]))
    for (start, stop), replay in zip(ctx.bounds[ctx.alpha_chunks :], ctx.pre_replays):
        with torch.no_grad(), replay.replay():
            rows.write(start, stop, ctx.split.project(_rows(x, start, stop), start, stop)[first:])
    return rows.tensors


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

        qkv = _HeadRows(x.shape[1])
        ctx.pre_graphs, ctx.pre_replays, ctx.qkv_refs = [], [], []
        with torch.enable_grad(), hooks:
            for start, stop in offloaded:
                mark_part("kept chunk projection")
                x_in = _Source.apply(anchor, _rows(x, start, stop))
                outputs = split.project(x_in, start, stop)
                ctx.pre_graphs.append((get_gradient_edge(x_in), [get_gradient_edge(t) for t in outputs]))
                outputs = tuple(t.detach() for t in outputs)
                ctx.qkv_refs.append([stash.add(t) for t in outputs])
                qkv.write(start, stop, outputs)
                del outputs
        with torch.no_grad():
            for start, stop in recomputed:
                mark_part("recomputed chunk projection")
                ctx.pre_replays.append(ReplayState.capture(x.device))
                qkv.write(start, stop, split.project(_rows(x, start, stop), start, stop))
        q, k, v = qkv.tensors
        del qkv
        ctx.attention_replay = None if keep_attention else ReplayState.capture(x.device)
        mark_part("attention")
        out, stats = core.forward(q, k, v, split.traits)
        runtime.attention_ran()
        del q, k, v
        out = _sequence_major(out)
        if keep_attention:  # a blocked backward reads the output one chunk of rows at a time, each from the host
            blocked = runs_in_blocks(core, x.shape[1], split.traits)
            ctx.o_ref, ctx.lse_ref, ctx.stats = stash.add(out, blocked), stash.add(stats.lse), replace(stats, lse=None)
            # each chunk's rows are read as the largest chunk's many rows from its first (one more at most), so
            # every fetch from the host takes the same bytes
            rows = max(stop - start for start, stop in bounds)
            ctx.o_row_refs = [stash.add(out[:, :, start : start + rows]) for start, _ in bounds] if blocked else None
            ctx.recomputed_out, post_hooks = None, hooks
        else:  # o_proj saves attention-output rows: rebuilt from the attention backward computes again
            ctx.recomputed_out = RecomputedInBackward(out)
            post_hooks = stash_hooks(stash, split.kept(), stash_them=False, recomputed=ctx.recomputed_out)
        o_rows = out.transpose(1, 2).reshape(*x.shape[:2], -1)  # a view: out is (B, S, h, D) in memory

        y, sides = None, []
        ctx.post_graphs, ctx.post_replays = [], []
        for chunk, (start, stop) in enumerate(bounds):
            mark_part("kept chunk finish" if chunk < len(offloaded) else "recomputed chunk finish")
            if chunk < len(offloaded):
                with torch.enable_grad(), post_hooks:
                    x_in = _Source.apply(anchor, _rows(x, start, stop))
                    o_in = _Source.apply(anchor, _rows(o_rows, start, stop))
                    y_rows, side = _finished(split.finish(x_in, o_in, start))
                    side_edges = [get_gradient_edge(t) if t.requires_grad else None for t in side]
                    ctx.post_graphs.append(
                        (get_gradient_edge(x_in), get_gradient_edge(o_in), get_gradient_edge(y_rows), side_edges)
                    )
                    y_rows, side = y_rows.detach(), [t.detach() for t in side]
            else:
                ctx.post_replays.append(ReplayState.capture(x.device))
                with torch.no_grad():
                    y_rows, side = _finished(split.finish(_rows(x, start, stop), _rows(o_rows, start, stop), start))
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
        params = ctx.saved_tensors
        # retain_graph=True: everything the layer keeps stays for the next backward through this graph
        keep = torch._C._autograd._get_current_graph_task_keep_graph()
        traits, length = ctx.split.traits, ctx.x_ref.shape[1]
        if runs_in_blocks(ctx.core, length, traits):
            ctx.runtime.fetch_below(stash, 0)  # then piece by piece, as it frees its keys' gradient sums
            backward = _blocked_backward
        else:
            ctx.runtime.fetch_below(stash, None)
            blocks_queries = getattr(ctx.core, "blocks_queries", None)
            held_keys = blocks_queries is not None and blocks_queries(length, traits)
            backward = _held_keys_backward if held_keys else _whole_backward
        wanted = list(ctx.needs_input_grad[7:])
        sums = GradSum(params, wanted)
        x = stash.rebuild(ctx.x_ref)
        grad_x = backward(ctx, x, grad_y, grad_sides, sums, keep)
        stash.release(keep)
        ctx.runtime.backward_done(stash, device)
        if ctx.recomputed_out is not None:
            ctx.recomputed_out.value = None
        if not keep:
            ctx.post_graphs = ctx.pre_graphs = ctx.stash = ctx.recomputed_out = None
        return (None, None, None, None, None, None, grad_x, *sums.result())


def runs_in_blocks(core: AttentionCore, length: int, traits: AttentionTraits) -> bool:
    """Whether the layer's backward runs attention one chunk of queries at a time (:mod:`.blocked_attention`): the
    core attends on this device's whole sequence of ``length`` positions (not packed, not sequence-parallel) and the
    traits allow it."""
    local = core is LocalAttention or type(core) is LocalAttention
    return local and blockable(length, traits)


def _finish_backward(ctx, chunk: int, x: torch.Tensor, o_rows: torch.Tensor, grad_y, grad_sides, sums, keep):
    """``(grad_x rows, grad_o rows)`` of chunk ``chunk`` through ``finish`` (its saved graph, or recomputed from
    ``x`` and ``o_rows``, the chunk's rows ``(B, s, H)`` and ``(B, s, h * D)``); parameter gradients go to ``sums``."""
    start, stop = ctx.bounds[chunk]
    wanted = list(ctx.needs_input_grad[7:])
    wanted_params = [p for p, w in zip(ctx.saved_tensors, wanted) if w]
    if chunk < ctx.alpha_chunks:
        x_edge, o_edge, y_edge, side_edges = ctx.post_graphs[chunk]
        outputs, upstream = _chunk_outputs(y_edge, side_edges, grad_y, grad_sides, x.shape[0], start, stop)
        grads = torch.autograd.grad(
            outputs, [x_edge, o_edge, *wanted_params], upstream, retain_graph=keep, allow_unused=True
        )
        return _accumulate(list(grads), 2, sums, wanted)
    x_rows = x.detach().requires_grad_(True)
    o_in = o_rows.detach().requires_grad_(True)
    with torch.enable_grad(), ctx.post_replays[chunk - ctx.alpha_chunks].replay():
        y_rows, side = _finished(ctx.split.finish(x_rows, o_in, start))
    side = [t if t.requires_grad else None for t in side]
    outputs, upstream = _chunk_outputs(y_rows, side, grad_y, grad_sides, x.shape[0], start, stop)
    grads = torch.autograd.grad(outputs, [x_rows, o_in, *wanted_params], upstream, allow_unused=True)
    return _accumulate(list(grads), 2, sums, wanted)


def _project_graph(ctx, chunk: int, x: torch.Tensor, keep: bool) -> tuple:
    """Chunk ``chunk``'s graph through ``project`` from its rows ``x`` ``(B, s, H)``: ``(input, outputs, retain)``,
    its saved graph's edges (offloaded chunks; ``retain``: ``keep``) or a graph recomputed now (q ``(B, h, s, D)``,
    k, v ``(B, h_kv, s, D)``) from ``x`` under the forward's RNG and autocast state."""
    if chunk < ctx.alpha_chunks:
        x_edge, edges = ctx.pre_graphs[chunk]
        return x_edge, edges, keep
    x_rows = x.detach().requires_grad_(True)
    start, stop = ctx.bounds[chunk]
    with torch.enable_grad(), ctx.pre_replays[chunk - ctx.alpha_chunks].replay():
        outputs = ctx.split.project(x_rows, start, stop)
    return x_rows, outputs, False


def _project_backward(ctx, graph: tuple, grads_qkv: list[torch.Tensor], sums: GradSum) -> torch.Tensor:
    """The gradient of a chunk's rows through its ``project`` ``graph`` (:func:`_project_graph`), given its outputs'
    gradients ``grads_qkv`` (dq ``(B, h, s, D)``, dk, dv ``(B, h_kv, s, D)``); parameter gradients go to ``sums``."""
    source, outputs, retain = graph
    wanted = list(ctx.needs_input_grad[7:])
    wanted_params = [p for p, w in zip(ctx.saved_tensors, wanted) if w]
    grads = torch.autograd.grad(outputs, [source, *wanted_params], grads_qkv, retain_graph=retain, allow_unused=True)
    (grad_pre,) = _accumulate(list(grads), 1, sums, wanted)
    return grad_pre


def _attention_rows(out: torch.Tensor) -> torch.Tensor:
    """Attention output ``(B, h, s, D)`` (a view of ``(B, s, h, D)`` memory) as rows ``(B, s, h * D)``, a view."""
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def _recomputed_output(ctx, device: torch.device) -> torch.Tensor | None:
    """For a layer keeping its input only, whose backward recomputes its attention output chunk by chunk: the
    whole output ``(B, h, S, D)`` its offloaded chunks' finish graphs read (they saved views of its rows), allocated
    and handed to them, or ``None`` without offloaded chunks. Counts the layer's attention as run (once per layer, in
    as many blocks as chunks)."""
    out = None
    if ctx.alpha_chunks:
        shape, stride, _ = ctx.recomputed_out.layout
        out = torch.empty_strided(shape, stride, dtype=ctx.recomputed_out.dtype, device=device)
        ctx.recomputed_out.value = out
    ctx.runtime.attention_ran()
    return out


def _blocked_backward(ctx, x: torch.Tensor, grad_y, grad_sides, sums, keep) -> torch.Tensor:
    """The layer's backward chunk by chunk, last chunk first, with attention in query blocks of the chunks.

    Chunk ``c``'s queries attend to the keys of chunks ``<= c``, so once chunk ``c`` is done the keys of chunk
    ``c`` have every gradient they get: its ``finish``, attention and ``project`` backward run back to back, and
    only k, v and their gradients are held for the whole sequence (dK/dV summed in fp32 for half inputs), with the
    gradient of ``x``, written over ``x`` itself where the stash owns its memory. A layer keeping its input only
    recomputes its chunk's attention output (and a layer whose offloaded chunks saved views of it, the whole
    output's rows, one chunk at a time).

    The keys' gradient sums are one piece per chunk, each freed once its chunk is done; as they go, the stash of
    the layer below fetches as many of its bytes as they gave back (:meth:`StashSource.fetch_below`), so its bytes
    arrive in that memory instead of beside it (what does not fit comes when its own backward begins). A layer that
    keeps its attention output reads it one chunk of rows at a time, the next chunk's fetched from the host while
    this one runs (:meth:`LayerStash.fetch_view`), never the whole output."""
    sums.reserve()  # held from the first chunk on: every chunk's moments alike (the estimator's fits rely on it)
    k, v = _rebuild_qkv(ctx, x, keys_only=True)
    key_sums = KeyGradSums(k, v, ctx.bounds)
    # A chunk's rows of x are read for the last time by its own backward: the gradient can take their place.
    grad_x = x if not keep and ctx.stash.owns(ctx.x_ref) else torch.empty_like(x)
    out = lse = None
    if ctx.keep_attention:
        lse = ctx.stash.rebuild(ctx.lse_ref)
    else:
        out = _recomputed_output(ctx, x.device)
    freed = 0
    for chunk in reversed(range(len(ctx.bounds))):
        freed += _chunk_backward(ctx, chunk, x, (k, v), key_sums, out, lse, grad_x, grad_y, grad_sides, sums, keep)
        ctx.runtime.fetch_below(ctx.stash, freed)
    return grad_x


def _chunk_backward(ctx, chunk, x, keys, key_sums, out, lse, grad_x, grad_y, grad_sides, sums, keep) -> int:
    """Chunk ``chunk``'s part of :func:`_blocked_backward`: its rows of ``grad_x`` written (its queries' attention
    over ``keys`` ``(k, v)`` recomputed if ``out`` is not kept), its keys' gradients added to ``key_sums`` and its
    own keys' sums taken out of them. Its tensors die on return; returns the bytes of its keys' sums, given back."""
    traits = ctx.split.traits
    start, stop = ctx.bounds[chunk]
    offloaded = chunk < ctx.alpha_chunks
    kind = "kept" if offloaded else "recomputed"
    mark_part(f"{kind} chunk backward")
    x_rows = _rows(x, start, stop)
    graph = _project_graph(ctx, chunk, x_rows, keep)
    q_rows = ctx.stash.rebuild(ctx.qkv_refs[chunk][0]) if offloaded else graph[1][0].detach()
    prefix = tuple(t[:, :, :stop] for t in keys)
    if ctx.keep_attention:
        if chunk > 0:  # the next chunk's output rows come from the host while this one runs
            ctx.stash.fetch_view(ctx.o_row_refs[chunk - 1])
        # held until the chunk's attention backward: its finish graph's saved rows (o_proj's input) are read from it
        out_rows = ctx.stash.hold_view(ctx.o_row_refs[chunk])[:, :, : stop - start]
        lse_rows = lse[:, :, start:stop]
    else:
        mark_part("attention forward")
        out_rows, lse_rows = block_forward(q_rows, *prefix, start, traits)
        if ctx.alpha_chunks:
            out[:, :, start:stop] = out_rows
    mark_part(f"{kind} chunk finish backward")
    grad_finish, grad_o = _finish_backward(
        ctx, chunk, x_rows, _attention_rows(out_rows), grad_y, grad_sides, sums, keep
    )
    grad_out = grad_o.view(*grad_o.shape[:2], q_rows.shape[1], -1).transpose(1, 2)
    dq, dsinks = block_backward(grad_out, q_rows, *prefix, out_rows, lse_rows, start, traits, key_sums)
    del grad_o, grad_out, out_rows, lse_rows, q_rows
    if ctx.keep_attention:
        ctx.stash.drop_view(ctx.o_row_refs[chunk])
    _add_sinks_grad(sums, ctx.saved_tensors, traits.sinks, dsinks)
    mark_part(f"{kind} chunk project backward")
    own_sums = key_sums.pop(start, stop)
    freed = sum(t.numel() * t.element_size() for t in own_sums)
    grads_qkv = [dq, *(g.to(t.dtype) for g, t in zip(own_sums, keys))]
    del own_sums
    del dq
    grad_project = _project_backward(ctx, graph, grads_qkv, sums)
    del graph, grads_qkv
    torch.add(grad_finish, grad_project, out=grad_x[:, start:stop])
    return freed


def _queries(ctx, chunk: int, x_rows: torch.Tensor) -> torch.Tensor:
    """Chunk ``chunk``'s q ``(B, h, s, D)``: stashed (offloaded chunks) or projected again from its rows ``x_rows``
    ``(B, s, H)`` under the forward's RNG and autocast state, without a graph."""
    if chunk < ctx.alpha_chunks:
        return ctx.stash.rebuild(ctx.qkv_refs[chunk][0])
    start, stop = ctx.bounds[chunk]
    with torch.no_grad(), ctx.pre_replays[chunk - ctx.alpha_chunks].replay():
        return ctx.split.project(x_rows, start, stop)[0]


def _held_keys_backward(ctx, x: torch.Tensor, grad_y, grad_sides, sums, keep) -> torch.Tensor:
    """The layer's backward with attention one chunk of queries at a time over keys the core holds throughout
    (:class:`QueryBlocks`); after the last chunk, when the keys' gradients are final, ``project`` backward chunk by
    chunk. A layer that keeps its attention output runs every chunk's ``finish`` backward first, keeping the output's
    gradient, and has the core hold the keys only then, so no chunk's MLP backward meets them; a layer keeping its
    input only runs each chunk's ``finish`` backward beside its attention (recomputed first, which needs the keys),
    so the output and its gradient are never held for the whole sequence. Either way the layer holds dq and the
    gradient of ``x`` for the whole sequence, one chunk of everything else.

    ``project``'s backward gets dq, dk and dv together, not dq per chunk and dk, dv later: the two calls' sum would
    round differently where the projection computes in a narrower dtype inside (e.g. an RMSNorm in fp32), and the
    gradient must be the unpatched model's."""
    sums.reserve()  # held from the first chunk on: every chunk's moments alike (the estimator's fits rely on it)
    traits = ctx.split.traits
    grad_x = torch.empty_like(x)
    grad_o = None
    if ctx.keep_attention:
        out = ctx.stash.rebuild(ctx.o_ref)
        o_rows = _attention_rows(out)
        grad_o = torch.empty_like(o_rows)
        for chunk, (start, stop) in enumerate(ctx.bounds):
            mark_part(f"{'kept' if chunk < ctx.alpha_chunks else 'recomputed'} chunk finish backward")
            grad_x[:, start:stop], grad_o[:, start:stop] = _finish_backward(
                ctx, chunk, _rows(x, start, stop), _rows(o_rows, start, stop), grad_y, grad_sides, sums, keep
            )
        del o_rows
    else:
        out = _recomputed_output(ctx, x.device)
    keys = _rebuild_qkv(ctx, x, keys_only=True)
    lse = ctx.stash.rebuild(ctx.lse_ref) if ctx.keep_attention else None
    dq = blocks = None
    for chunk, (start, stop) in enumerate(ctx.bounds):
        kind = "kept" if chunk < ctx.alpha_chunks else "recomputed"
        mark_part(f"{kind} chunk backward")
        x_rows = _rows(x, start, stop)
        q_rows = _queries(ctx, chunk, x_rows)
        if blocks is None:
            blocks = ctx.core.query_blocks(q_rows.shape[1], keys, lse, traits)
            del keys, lse
            dq = q_rows.new_empty(x.shape[0], x.shape[1], *q_rows.shape[1::2]).transpose(1, 2)
        if ctx.keep_attention:
            out_rows, grad_o_rows = out[:, :, start:stop], grad_o[:, start:stop]
        else:
            mark_part("attention forward")
            out_rows = _sequence_major(blocks.forward(q_rows, start, stop))
            if ctx.alpha_chunks:
                out[:, :, start:stop] = out_rows
            mark_part(f"{kind} chunk finish backward")
            grad_x[:, start:stop], grad_o_rows = _finish_backward(
                ctx, chunk, x_rows, _attention_rows(out_rows), grad_y, grad_sides, sums, keep
            )
        grad_out = grad_o_rows.view(*grad_o_rows.shape[:2], q_rows.shape[1], -1).transpose(1, 2)
        dq[:, :, start:stop] = blocks.backward(grad_out, q_rows, out_rows, start, stop)
        del grad_o_rows, grad_out, out_rows, q_rows
    del out, grad_o
    if ctx.recomputed_out is not None:
        ctx.recomputed_out.value = None  # read by the finish graphs only, which are done
    dk, dv, dsinks = blocks.key_grads()
    del blocks
    _add_sinks_grad(sums, ctx.saved_tensors, traits.sinks, dsinks)
    for chunk, (start, stop) in enumerate(ctx.bounds):
        mark_part("chunk project backward")
        grads_qkv = [t[:, :, start:stop] for t in (dq, dk, dv)]
        graph = _project_graph(ctx, chunk, _rows(x, start, stop), keep)
        grad_x[:, start:stop] += _project_backward(ctx, graph, grads_qkv, sums)
    return grad_x


def _whole_backward(ctx, x: torch.Tensor, grad_y, grad_sides, sums, keep) -> torch.Tensor:
    """The layer's backward with attention on the whole sequence at once: ``finish`` chunk by chunk, the attention
    core's backward, then ``project`` chunk by chunk."""
    split: LayerSplit = ctx.split
    stash: LayerStash = ctx.stash
    if ctx.keep_attention:
        q = k = v = None
        out, stats = stash.rebuild(ctx.o_ref), replace(ctx.stats, lse=stash.rebuild(ctx.lse_ref))
    else:
        q, k, v = _rebuild_qkv(ctx, x)
        with torch.no_grad(), ctx.attention_replay.replay():
            out, stats = ctx.core.forward(q, k, v, split.traits)
        ctx.runtime.attention_ran()
        out = ctx.recomputed_out.value = _sequence_major(out)
    o_rows = _attention_rows(out)
    grad_x = torch.empty_like(x)
    grad_o = torch.empty_like(o_rows)
    for chunk, (start, stop) in enumerate(ctx.bounds):
        grad_x[:, start:stop], grad_o[:, start:stop] = _finish_backward(
            ctx, chunk, _rows(x, start, stop), _rows(o_rows, start, stop), grad_y, grad_sides, sums, keep
        )
    if q is None:
        q, k, v = _rebuild_qkv(ctx, x)
    if ctx.recomputed_out is not None:
        ctx.recomputed_out.value = None  # read by the finish graphs only, which are done
    held = [grad_o.view(*grad_o.shape[:2], q.shape[1], -1).transpose(1, 2), q, k, v, out]
    del grad_o, o_rows, q, k, v, out
    releasing = getattr(ctx.core, "backward_releasing", None)
    if releasing is not None:  # a core that exchanges its inputs frees each one the layer no longer holds
        dq, dk, dv, dsinks = releasing(held, stats, split.traits)
    else:
        dq, dk, dv, dsinks = ctx.core.backward(*held, stats, split.traits)
    del held
    _add_sinks_grad(sums, ctx.saved_tensors, split.traits.sinks, dsinks)
    for chunk, (start, stop) in enumerate(ctx.bounds):
        grads_qkv = [t[:, :, start:stop] for t in (dq, dk, dv)]
        graph = _project_graph(ctx, chunk, _rows(x, start, stop), keep)
        grad_x[:, start:stop] += _project_backward(ctx, graph, grads_qkv, sums)
    return grad_x
