"""``recompute="selective"`` with a fused attention op that draws its own dropout mask.

On CUDA, SDPA's flash, efficient and cuDNN kernels draw the attention dropout mask inside the fused call and
advance the device generator. CPU SDPA takes the math path when dropout is on, so the suite stands such a
kernel in with a custom op that draws from the CPU generator inside one call: saved by the selective policy
instead of re-run, the recomputation would draw GPT-2's residual and MLP dropout masks from another generator
state than the forward did.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface

import hf_memo
from hf_memo.patches import forwards
from tests.conftest import assert_same_grads, build_model, make_batch

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off")


def _attention(q, k, v, keep, dropout_p, scale):
    """Causal attention ``(B, h, S, D)`` with the dropout mask ``keep`` ``(B, h, S, S)``."""
    scores = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return (weights * keep / (1 - dropout_p)) @ v


# A fused op with an autograd kernel of its own that keeps grad mode on when it calls the kernel below, as
# aten's CUDA attention ops do (an autograd.Function's forward would run it under no_grad, which the selective
# policy never saves).
_LIBRARY = torch.library.Library("hf_memo_test", "DEF")
_LIBRARY.define(
    "fused_dropout_attention(Tensor q, Tensor k, Tensor v, float dropout_p, float scale) -> (Tensor, Tensor)"
)


def _fused_kernel(q, k, v, dropout_p, scale):
    """One call: draws its dropout mask from the generator and attends; returns ``(out, mask)``."""
    keep = torch.rand(*q.shape[:-1], k.shape[-2], dtype=q.dtype, device=q.device) >= dropout_p
    return _attention(q, k, v, keep, dropout_p, scale), keep


class _Differentiate(torch.autograd.Function):
    """Attaches the fused op's outputs to autograd: ``out``'s gradient flows to ``q``, ``k``, ``v``."""

    @staticmethod
    def forward(ctx, q, k, v, out, keep, dropout_p, scale):
        ctx.save_for_backward(q, k, v, keep)
        ctx.dropout_p, ctx.scale = dropout_p, scale
        ctx.mark_non_differentiable(keep)
        return out.view_as(out), keep

    @staticmethod
    def backward(ctx, grad_out, _grad_keep):
        q, k, v, keep = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = _attention(*leaves, keep, ctx.dropout_p, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, leaves, grad_out)
        return dq, dk, dv, None, None, None, None


def _fused_autograd(q, k, v, dropout_p, scale):
    with torch._C._AutoDispatchBelowAutograd():  # grad mode stays on, as under aten's autograd kernels
        out, keep = FUSED(q, k, v, dropout_p, scale)
    return _Differentiate.apply(q, k, v, out, keep, dropout_p, scale)


FUSED = torch.ops.hf_memo_test.fused_dropout_attention.default
_LIBRARY.impl("fused_dropout_attention", _fused_kernel, "CPU")
_LIBRARY.impl("fused_dropout_attention", _fused_autograd, "Autograd")


def _fused_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    out, _ = FUSED(query, key, value, dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("test_fused_dropout", _fused_attention)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_a_fused_attention_op_that_draws_dropout_is_recomputed_so_later_masks_match(recompute, monkeypatch):
    monkeypatch.setattr(forwards, "SELECTIVE_SAVE_OPS", forwards.SELECTIVE_SAVE_OPS | {FUSED})
    dropout = {"attn_pdrop": 0.2, "resid_pdrop": 0.1, "embd_pdrop": 0.1}
    reference = build_model("gpt2", n_layer=3, attn_implementation="test_fused_dropout", **dropout)
    model = hf_memo.apply(copy.deepcopy(reference), recompute=recompute, mlp_chunks=3, lm_head_chunks=2)
    ids, labels = make_batch(2, 11)
    losses = []
    for m in (model, reference):
        torch.manual_seed(7)
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def test_the_selective_policy_saves_fused_attention_without_dropout_and_recomputes_it_with_dropout():
    q = torch.zeros(1, 1, 2, 4)
    saved = forwards.CheckpointPolicy.MUST_SAVE
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert forwards._keep_matmuls_and_attention(None, flash, q, q, q, 0.0, True) == saved
    assert forwards._keep_matmuls_and_attention(None, flash, q, q, q, 0.1, True) != saved
    assert forwards._keep_matmuls_and_attention(None, efficient, q, q, q, None, False, dropout_p=0.1) != saved
    assert forwards._keep_matmuls_and_attention(None, efficient, q, q, q, None, False) == saved  # default 0
