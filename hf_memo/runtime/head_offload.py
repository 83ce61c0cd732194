"""The LM head's input on the host between forward and backward, under ``recompute="memo"``.

The mini-sequence loss keeps only the final hidden states ``(B, S, H)`` for its backward (the final
norm and the logits are recomputed chunk by chunk). Once the memo executor has moved every other
layer's input to the host, this one tensor is as large as what the two unswapped top layers keep.
So it is swapped like a layer's stash: copied to a pooled host buffer on the device-to-host stream when the
loss's forward ends (behind the rest of the forward), and fetched back when the loss's backward starts. That
fetch is not hidden behind compute (it is the first thing backward needs): one layer input's bytes, against
the LM head's full backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hf_memo.runtime.memo import MemoRuntime
from hf_memo.runtime.stash import LayerStash, stash_hooks


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity on ``hidden``; its backward runs after everything that read the stash, and releases it."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, stash: LayerStash) -> torch.Tensor:
        ctx.stash = stash
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        keep = torch._C._autograd._get_current_graph_task_keep_graph()  # retain_graph=True: a backward follows
        ctx.stash.release(keep)
        if not keep:
            ctx.stash = None
        return grad, None


@contextmanager
def head_input_offloaded(runtime: MemoRuntime | None, hidden: torch.Tensor) -> Iterator[torch.Tensor]:
    """Run the loss on the yielded tensor (``hidden`` ``(B, S, H)`` or a view of it) to keep it on the host.

    Saved tensors sharing ``hidden``'s storage go to a swapped stash; others are untouched. Nothing
    changes without a memo runtime, without a graph to differentiate, or when the runtime keeps the
    head input on the device (see :meth:`MemoRuntime.open_head_stash`).
    """
    stash = None
    if runtime is not None and torch.is_grad_enabled() and hidden.requires_grad:
        stash = runtime.open_head_stash(hidden)
    if stash is None:
        yield hidden
        return
    with stash_hooks(stash, [hidden], stash_them=True):
        yield _ReleaseAfterBackward.apply(hidden, stash)
    stash.seal()
