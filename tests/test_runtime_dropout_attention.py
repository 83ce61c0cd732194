"""The CPU attention-with-dropout pair against autograd through explicit math with the same mask."""

import pytest
import torch

from hf_memo.runtime import dropout_attention
from hf_memo.runtime.attention_core import expand_kv
from hf_memo.runtime.dropout_attention import (
    draw_seed,
    dropout_attention_backward,
    dropout_attention_forward,
    keep_mask,
)

CPU = torch.device("cpu")


def _explicit(q, k, v, scale, keep, p):
    """Causal attention with dropout written out (autograd reference): ``softmax(QK^T) * keep / (1 - p) @ V``."""
    groups = q.shape[1] // k.shape[1]
    seq = q.shape[2]
    scores = q @ expand_kv(k, groups).transpose(-1, -2) * scale
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    return (scores.softmax(-1) * keep / (1 - p)) @ expand_kv(v, groups)


def test_mask_keeps_the_expected_fraction_and_any_block_is_a_slice_of_the_whole():
    whole = keep_mask(11, 0.2, 2, 3, 64, (0, 64), 64, CPU)
    assert whole.shape == (2, 3, 64, 64) and whole.dtype == torch.bool
    assert abs(whole.float().mean().item() - 0.8) < 0.01
    assert torch.equal(keep_mask(11, 0.2, 2, 3, 64, (17, 40), 40, CPU), whole[:, :, 17:40, :40])
    assert not torch.equal(keep_mask(12, 0.2, 2, 3, 64, (0, 64), 64, CPU), whole)
    # no correlation between neighbouring keys, heads or sequences
    flat = whole.float() - 0.8
    for a, b in ((flat[..., 1:], flat[..., :-1]), (flat[:, 1:], flat[:, :-1]), (flat[1:], flat[:-1])):
        assert abs((a * b).mean().item()) < 0.01


def test_seeds_come_from_the_default_generator():
    torch.manual_seed(3)
    first = draw_seed()
    assert draw_seed() != first
    torch.manual_seed(3)
    assert draw_seed() == first


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("seq,block_elements", [(1, 1 << 22), (13, 60), (40, 1 << 22)])
def test_forward_and_backward_equal_autograd_through_explicit_math(monkeypatch, heads, kv_heads, seq, block_elements):
    monkeypatch.setattr(dropout_attention, "BLOCK_ELEMENTS", block_elements)  # 60: blocks of a few rows
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, seq, heads, 8, dtype=torch.float64, generator=gen).transpose(1, 2)  # (B, S, h, D) memory
    k = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, generator=gen)
    v = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, generator=gen)
    upstream = torch.randn(2, heads, seq, 8, dtype=torch.float64, generator=gen)
    p, seed = 0.3, 1234
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    keep = keep_mask(seed, p, 2, heads, seq, (0, seq), seq, CPU)
    want = _explicit(*leaves, 0.35, keep, p)
    want.backward(upstream)

    out, lse = dropout_attention_forward(q, k, v, 0.35, p, seed)
    assert out.stride() == q.stride() and lse.shape == (2, heads, seq)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    grads = dropout_attention_backward(upstream, q, k, v, out, lse, 0.35, p, seed)
    for got, leaf in zip(grads, leaves):
        assert got.shape == leaf.shape
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)


def test_reduced_precision_inputs_are_computed_in_float32():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=gen) for _ in range(3))
    out, lse = dropout_attention_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.3, 0.1, 5)
    want, want_lse = dropout_attention_forward(*(t.bfloat16().float() for t in (q, k, v)), 0.3, 0.1, 5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, want.bfloat16())
    torch.testing.assert_close(lse, want_lse)
