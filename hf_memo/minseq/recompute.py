"""A row-chunked computation that keeps only its input and recomputes one chunk at a time in backward.

This is the engine of both mini-sequence ops. Forward runs ``fn`` over row chunks without building
a graph and either writes the chunk outputs into one tensor (``"cat"``: the MLP) or sums them
(``"sum"``: the loss). Backward recomputes each chunk under the RNG and autocast state of its
forward and differentiates it alone, so at most one chunk's intermediates are alive in either pass.
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

# fn(rows, start, stop) -> output for rows [start, stop) of the input.
ChunkFunction = Callable[[torch.Tensor, int, int], torch.Tensor]
Reduce = Literal["cat", "sum"]


def _forward_chunks(
    fn: ChunkFunction, x: torch.Tensor, bounds: list[tuple[int, int]], reduce: Reduce, replays: list | None
) -> torch.Tensor:
    x = x.detach()
    out = None
    for start, stop in bounds:
        if replays is not None:
            replays.append(ReplayState.capture(x.device))
        y = fn(x[start:stop], start, stop)
        if reduce == "sum":
            out = y if out is None else out + y
        else:
            if out is None:
                out = y.new_empty((x.shape[0], *y.shape[1:]))
            out[start:stop] = y
    return out


class _ChunkedRecompute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, fn: ChunkFunction, bounds: list[tuple[int, int]], reduce: Reduce, x: torch.Tensor, *params: torch.Tensor
    ):
        ctx.fn, ctx.bounds, ctx.reduce = fn, bounds, reduce
        ctx.replays = []
        out = _forward_chunks(fn, x, bounds, reduce, ctx.replays)
        ctx.save_for_backward(x, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        wanted = list(ctx.needs_input_grad[4:])
        wanted_params = [p for p, w in zip(params, wanted) if w]
        grad_x = torch.empty_like(x) if need_x else None
        sums = GradSum(params, wanted)
        with autocast_cache_kept(x.device):
            for (start, stop), replay in zip(ctx.bounds, ctx.replays):
                rows = x[start:stop].detach().requires_grad_(need_x)
                with torch.enable_grad(), replay.replay():
                    y = ctx.fn(rows, start, stop)
                upstream = grad_out if ctx.reduce == "sum" else grad_out[start:stop]
                inputs = ([rows] if need_x else []) + wanted_params
                grads = list(torch.autograd.grad(y, inputs, upstream, allow_unused=True))
                if need_x:
                    chunk_grad = grads.pop(0)
                    grad_x[start:stop] = 0 if chunk_grad is None else chunk_grad
                remaining = iter(grads)
                sums.add([next(remaining) if w else None for w in wanted])
        return (None, None, None, grad_x, *sums.result())


def run_chunked(
    fn: ChunkFunction,
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    bounds: list[tuple[int, int]],
    reduce: Reduce,
) -> torch.Tensor:
    """Run ``fn`` over the row ranges ``bounds`` of ``x`` ``(N, H)``; concatenate or sum the outputs.

    Args:
        fn: ``fn(rows, start, stop)``: the computation for rows ``[start, stop)``; rows are
            independent of each other (dropout allowed: its RNG state is replayed).
        x: ``(N, H)`` input rows.
        params: tensors ``fn`` uses that may need gradients (e.g. trainable parameters).
        bounds: half-open row ranges covering ``range(N)`` (see ``chunk_bounds``).
        reduce: ``"cat"``: outputs ``(n, ...)`` written into one ``(N, ...)`` tensor; ``"sum"``:
            outputs added up.

    Returns:
        The concatenated ``(N, ...)`` or summed output; its gradients for ``x`` and ``params``
        equal those of the unchunked computation up to float summation order. A single chunk runs
        ``fn`` directly under autograd: nothing is recomputed, short sequences lose no speed.
    """
    if len(bounds) == 1:
        return fn(x, *bounds[0])
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        if torch.compiler.is_compiling():
            return _checkpointed_chunks(fn, x, bounds, reduce)
        return _ChunkedRecompute.apply(fn, bounds, reduce, x, *params)
    return _forward_chunks(fn, x, bounds, reduce, None)


def _checkpointed_chunks(fn: ChunkFunction, x: torch.Tensor, bounds: list[tuple[int, int]], reduce: Reduce):
    """The same computation for ``torch.compile``, which cannot trace :class:`_ChunkedRecompute` (its backward
    differentiates inside backward and replays RNG state): each chunk is a ``torch.utils.checkpoint`` region,
    which the compiler recomputes in backward, so chunk intermediates are still not kept."""
    outputs = [checkpoint(fn, x[start:stop], start, stop, use_reentrant=False) for start, stop in bounds]
    return torch.cat(outputs) if reduce == "cat" else sum(outputs[1:], outputs[0])
