"""checkpoint_call (hf_memo/patches/checkpoint_call.py): a checkpointed forward that raises leaves no saved-tensor
hooks behind, whichever torch (up to 2.11 torch's own checkpoint leaves them while the exception is kept)."""

from __future__ import annotations

import pytest
import torch

from hf_memo.patches.checkpoint_call import checkpoint_call


def _top_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def test_a_forward_that_raises_leaves_no_hooks_and_later_graphs_recompute_their_own_calls():
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def fails(t, *, mask):
        t.sin()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom") as kept:  # the failure is kept, as the self-check keeps it
        checkpoint_call(fails, x, mask=torch.zeros(0))
    assert kept.value.__traceback__ is not None
    assert _top_hooks() is None
    calls = []

    def works(t, *, mask):
        calls.append(mask.shape)
        return (t.sin() * mask).sum()

    mask = torch.full((4,), 2.0, dtype=torch.float64)
    checkpoint_call(works, x, mask=mask).backward()
    assert calls == [(4,), (4,)]  # its forward and its own recomputation, not the failed call's
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


def test_a_recomputation_that_raises_raises_in_backward():
    x = torch.randn(3, requires_grad=True)
    runs = []

    def second_run_fails(t):
        runs.append(1)
        if len(runs) > 1:
            raise RuntimeError("recompute failed")
        return t.exp().sum()

    out = checkpoint_call(second_run_fails, x)
    with pytest.raises(RuntimeError, match="recompute failed"):
        out.backward()
