import pytest
import torch
import torch.nn.functional as F

from hf_memo.runtime.attention_core import attention_backward, attention_forward, backend_for, expand_kv, reduce_kv


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("seq", [1, 13, 64])
def test_forward_and_backward_equal_autograd_through_sdpa(heads, kv_heads, seq):
    torch.manual_seed(0)
    q = torch.randn(2, heads, seq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    groups = heads // kv_heads
    ref = F.scaled_dot_product_attention(q, expand_kv(k, groups), expand_kv(v, groups), is_causal=True, scale=0.3)
    upstream = torch.randn_like(ref)
    ref.backward(upstream)
    out, stats = attention_forward(q.detach(), k.detach(), v.detach(), 0.3)
    assert not out.requires_grad and stats.lse.shape == (2, heads, seq)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    dq, dk, dv = attention_backward(upstream, q.detach(), k.detach(), v.detach(), out, stats, 0.3)
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_expand_and_reduce_kv_are_adjoint():
    x = torch.arange(2 * 3 * 5 * 4, dtype=torch.float64).view(2, 3, 5, 4)
    expanded = expand_kv(x, 2)
    assert torch.equal(expanded[:, 0], x[:, 0]) and torch.equal(expanded[:, 1], x[:, 0])
    assert torch.equal(expanded[:, 2], x[:, 1])
    assert torch.equal(reduce_kv(expanded, 2), 2 * x)
    assert expand_kv(x, 1) is x


def test_cpu_backend_is_the_cpu_flash_kernel():
    assert backend_for(torch.empty(1, 1, 1, 1)) == "cpu-flash"
    with pytest.raises(ValueError, match="supports cpu and cuda"):
        backend_for(torch.empty(1, 1, 1, 1, device="meta"))
