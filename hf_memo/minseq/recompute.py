"""A row-chunked computation that keeps only its input and recomputes one chunk at a time in backward.

This is the engine of both mini-sequence ops. Forward runs ``fn`` over row chunks without building
a graph and either writes the chunk outputs into one tensor per output (``"cat"``: the MLP, whose
mixture-of-experts blocks also give their router logits) or sums them (``"sum"``: the loss). Backward
recomputes each chunk under the RNG and autocast state of its forward and differentiates it alone (every
output that got a gradient at once), so at most one chunk's intermediates are alive in either pass.
Parameters are inputs of the autograd function and their gradients are returned from ``backward``
(never written to ``.grad``), so DDP/FSDP/PEFT gradient hooks see each of them exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from hf_memo.minseq.grads import GradSum
from hf_memo.minseq.replay import ReplayState, autocast_cache_kept

# fn(rows, start, stop) -> output(s) for rows [start, stop) of the input: one tensor, or a tuple of them.
ChunkOutput = torch.Tensor | tuple[torch.Tensor, ...]
ChunkFunction = Callable[[torch.Tensor, int, int], ChunkOutput]
Reduce = Literal["cat", "sum"]


class _Tupled:
    """``fn`` with its output always a tuple; ``single`` says whether ``fn`` returned one tensor."""

    def __init__(self, fn: ChunkFunction) -> None:
        self.fn, self.single = fn, True

    def __call__(self, rows: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        out = self.fn(rows, start, stop)
        self.single = not isinstance(out, tuple)
        return (out,) if self.single else out


def _forward_chunks(
    fn: _Tupled, x: torch.Tensor, bounds: list[tuple[int, int]], reduce: Reduce, replays: list | None
) -> tuple[torch.Tensor, ...]:
    x = x.detach()
    outs: list[torch.Tensor] | None = None
    for start, stop in bounds:
        if replays is not None:
            replays.append(ReplayState.capture(x.device))
        ys = fn(x[start:stop], start, stop)
        if reduce == "sum":
            outs = list(ys) if outs is None else [out + y for out, y in zip(outs, ys)]
            continue
        if outs is None:
            outs = [y.new_empty((x.shape[0], *y.shape[1:])) for y in ys]
        for out, y in zip(outs, ys):
            out[start:stop] = y
    return tuple(outs)


class _ChunkedRecompute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, fn: _Tupled, bounds: list[tuple[int, int]], reduce: Reduce, x: torch.Tensor, *params: torch.Tensor
    ):
        ctx.fn, ctx.bounds, ctx.reduce = fn, bounds, reduce
        ctx.replays = []
        ctx.set_materialize_grads(False)  # an output nothing reads (e.g. unused router logits) costs no backward
        outs = _forward_chunks(fn, x, bounds, reduce, ctx.replays)
        ctx.save_for_backward(x, *params)
        return outs

    @staticmethod
    def backward(ctx, *grad_outs: torch.Tensor | None):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        wanted = list(ctx.needs_input_grad[4:])
        wanted_params = [p for p, w in zip(params, wanted) if w]
        grad_x = torch.zeros_like(x) if need_x else None
        sums = GradSum(params, wanted)
        with autocast_cache_kept(x.device):
            for (start, stop), replay in zip(ctx.bounds, ctx.replays):
                rows = x[start:stop].detach().requires_grad_(need_x)
                with torch.enable_grad(), replay.replay():
                    ys = ctx.fn(rows, start, stop)
                pairs = [
                    (y, grad if ctx.reduce == "sum" else grad[start:stop])
                    for y, grad in zip(ys, grad_outs)
                    if grad is not None and y.requires_grad
                ]
                if not pairs:
                    continue
                outputs, upstream = zip(*pairs)
                inputs = ([rows] if need_x else []) + wanted_params
                grads = list(torch.autograd.grad(outputs, inputs, upstream, allow_unused=True))
                if need_x:
                    chunk_grad = grads.pop(0)
                    if chunk_grad is not None:
                        grad_x[start:stop] = chunk_grad
                remaining = iter(grads)
                sums.add([next(remaining) if w else None for w in wanted])
        return (None, None, None, grad_x, *sums.result())


def run_chunked(
    fn: ChunkFunction,
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    bounds: list[tuple[int, int]],
    reduce: Reduce,
) -> ChunkOutput:
    """Run ``fn`` over the row ranges ``bounds`` of ``x`` ``(N, H)``; concatenate or sum the outputs.

    Args:
        fn: ``fn(rows, start, stop)``: the computation for rows ``[start, stop)``, one tensor or a tuple of
            tensors (the same count for every chunk); rows are independent of each other (dropout allowed:
            its RNG state is replayed).
        x: ``(N, H)`` input rows.
        params: tensors ``fn`` uses that may need gradients (e.g. trainable parameters).
        bounds: half-open row ranges covering ``range(N)`` (see ``chunk_bounds``).
        reduce: ``"cat"``: each output ``(n, ...)`` written into one ``(N, ...)`` tensor; ``"sum"``:
            each output added up over the chunks.

    Returns:
        What ``fn`` returns (a tensor or a tuple), concatenated or summed over the chunks; the gradients for
        ``x`` and ``params`` through any of the outputs equal those of the unchunked computation up to float
        summation order. A single chunk runs ``fn`` directly under autograd: nothing is recomputed, short
        sequences lose no speed.
    """
    if len(bounds) == 1:
        return fn(x, *bounds[0])
    differentiable = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    if differentiable and torch.compiler.is_compiling():
        return _checkpointed_chunks(fn, x, bounds, reduce)
    tupled = _Tupled(fn)
    if differentiable:
        outs = _ChunkedRecompute.apply(tupled, bounds, reduce, x, *params)
    else:
        outs = _forward_chunks(tupled, x, bounds, reduce, None)
    return outs[0] if tupled.single else outs


def _checkpointed_chunks(
    fn: ChunkFunction, x: torch.Tensor, bounds: list[tuple[int, int]], reduce: Reduce
) -> ChunkOutput:
    """The same computation for ``torch.compile``, which cannot trace :class:`_ChunkedRecompute` (its backward
    differentiates inside backward and replays RNG state): each chunk is a ``torch.utils.checkpoint`` region,
    which the compiler recomputes in backward, so chunk intermediates are still not kept."""
    chunks = [checkpoint(fn, x[start:stop], start, stop, use_reentrant=False) for start, stop in bounds]
    if not isinstance(chunks[0], tuple):
        return torch.cat(chunks) if reduce == "cat" else sum(chunks[1:], chunks[0])
    if reduce == "cat":
        return tuple(torch.cat(parts) for parts in zip(*chunks))
    return tuple(sum(parts[1:], parts[0]) for parts in zip(*chunks))
