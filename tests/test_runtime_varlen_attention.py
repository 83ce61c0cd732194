"""The per-sample attention core against autograd through SDPA on each sample alone (fp64)."""

import pytest
import torch
import torch.nn.functional as F

from hf_memo.runtime.attention_core import AttentionStats, LocalAttention
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.batch_layout import BatchLayout
from hf_memo.runtime.varlen_attention import (
    ROW_KEYWORDS,
    PackedKernels,
    VarlenAttention,
    attend_per_sample,
    attention_core_for,
)
from tests.torch_flash_stand_in import TorchFlashOnCpu

ROWS = (((0, 3), (3, 8), (8, 9), (9, 13)), ((2, 11),))  # packed samples; a row with padding on both sides
TRAITS = AttentionTraits(0.3)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_each_sample_attends_only_to_itself_and_padding_gets_nothing(kv_heads):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 13, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 13, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in "kv")
    grad_out = torch.randn(2, 4, 13, 8, dtype=torch.float64, generator=gen)
    core = VarlenAttention(BatchLayout(13, ROWS))
    out, stats = core.forward(q.detach(), k.detach(), v.detach(), TRAITS)
    grad_rows = grad_out.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, dsinks = core.backward(grad_rows, q, k, v, out, stats, TRAITS)
    assert dsinks is None

    want = torch.zeros_like(out)
    for row, spans in enumerate(ROWS):
        for start, stop in spans:
            part = slice(row, row + 1), slice(None), slice(start, stop)
            want[part] = F.scaled_dot_product_attention(
                q[part], k[part], v[part], is_causal=True, scale=0.3, enable_gqa=kv_heads != 4
            )
    want.backward(grad_out)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    for got, expected in zip((dq, dk, dv), (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert (out[1, :, :2] == 0).all() and (dq[1, :, 11:] == 0).all() and (dk[1, :, :2] == 0).all()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_trained_padding_attends_as_transformers_causal_and_padding_mask_gives(kv_heads):
    """Padding after a sample with targets: SDPA with transformers' mask (causal and real keys) on the whole row,
    the queries of padding before a sample (all keys masked) giving zeros."""
    gen = torch.Generator().manual_seed(1)
    real = torch.tensor([[1] * 4 + [0] * 5, [0, 0] + [1] * 5 + [0, 0], [1] * 9])
    q = torch.randn(3, 4, 9, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(3, kv_heads, 9, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in "kv")
    grad_out = torch.randn(3, 4, 9, 8, dtype=torch.float64, generator=gen)
    layout = BatchLayout(9, (((0, 4),), ((2, 7),), ((0, 9),)), padding_attends=True)
    out, stats = VarlenAttention(layout).forward(q.detach(), k.detach(), v.detach(), TRAITS)
    dq, dk, dv, _ = VarlenAttention(layout).backward(grad_out, q, k, v, out, stats, TRAITS)

    mask = torch.ones(9, 9, dtype=torch.bool).tril() & real.bool()[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=kv_heads != 4)
    want.backward(grad_out)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    for got, expected in zip((dq, dk, dv), (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert (out[1, :, :2] == 0).all() and (out[0, :, 4:] != 0).all()


def test_plain_rows_use_the_whole_row_core():
    assert isinstance(attention_core_for(None), LocalAttention)
    assert isinstance(attention_core_for(BatchLayout(5)), LocalAttention)
    assert isinstance(attention_core_for(BatchLayout(5, (((0, 5),),))), VarlenAttention)


def test_attention_functions_get_one_sample_each_and_no_row_descriptions():
    calls = []

    def attend(module, q, k, v, mask, **kwargs):
        calls.append((q.shape[2], mask, sorted(kwargs)))
        return q.transpose(1, 2) * 2, None

    q = torch.randn(2, 4, 13, 8)
    row_kwargs = {name: object() for name in ROW_KEYWORDS}
    out = attend_per_sample(attend, None, q, q[:, :2], q[:, :2], BatchLayout(13, ROWS), {"scaling": 0.5, **row_kwargs})
    assert calls == [(n, None, ["scaling"]) for n in (3, 5, 1, 4, 9)]
    torch.testing.assert_close(out[0], q[0].transpose(0, 1) * 2)
    assert (out[1, :2] == 0).all() and (out[1, 11:] == 0).all()


class CountingCpuPackedKernels:
    """Stands in for the CUDA varlen flash kernel on the CPU: the same packed ``(total, h, D)`` interface, each
    sample of ``cu`` attended with the CPU core; counts its calls."""

    calls = 0

    @classmethod
    def forward(cls, q, k, v, cu, longest, scale, p, window=None):
        cls.calls += 1
        assert q.is_contiguous() and q.dim() == 3 and longest == int((cu[1:] - cu[:-1]).max()) and window is None
        outs, lses = [], []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            sample = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]  # (1, h, s, D)
            out, stats = LocalAttention.forward(*sample, AttentionTraits(scale, p))
            outs.append(out[0].transpose(0, 1))
            lses.append(stats.lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1), ()

    @classmethod
    def backward(cls, grad_out, q, k, v, out, lse, extra, cu, longest, scale, p, window=None):
        grads = [[], [], []]
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            sample = [t[a:b].transpose(0, 1)[None] for t in (grad_out, q, k, v, out)]
            stats = AttentionStats(lse[:, a:b][None])
            for parts, g in zip(grads, LocalAttention.backward(*sample, stats, AttentionTraits(scale, p))):
                parts.append(g[0].transpose(0, 1))
        return tuple(torch.cat(parts) for parts in grads)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_packed_path_gathers_the_samples_into_one_call_and_scatters_results_back(kv_heads):
    """Where the varlen kernel serves (CUDA, stood in here), one call attends every sample of the batch: output and
    gradients equal the per-sample path's, padding zero, in the inputs' layouts."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 13, 4, 8, dtype=torch.float64, generator=gen).transpose(1, 2)  # (B, h, S, D) views
    k, v = (torch.randn(2, 13, kv_heads, 8, dtype=torch.float64, generator=gen).transpose(1, 2) for _ in "kv")
    grad_out = torch.randn(2, 4, 13, 8, dtype=torch.float64, generator=gen)
    layout = BatchLayout(13, ROWS)
    CountingCpuPackedKernels.calls = 0
    packed = VarlenAttention(layout, packed=CountingCpuPackedKernels)
    out, stats = packed.forward(q, k, v, TRAITS)
    grads = packed.backward(grad_out, q, k, v, out, stats, TRAITS)[:3]
    assert CountingCpuPackedKernels.calls == 1 and stats.lse.shape == (4, 3 + 5 + 1 + 4 + 9)
    per_sample = VarlenAttention(layout)
    want_out, want_stats = per_sample.forward(q, k, v, TRAITS)
    want_grads = per_sample.backward(grad_out, q, k, v, want_out, want_stats, TRAITS)[:3]
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert out.transpose(1, 2).is_contiguous()  # the executor keeps rows as views of (B, S, h, D) memory
    for got, want, like in zip(grads, want_grads, (q, k, v)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert got.shape == like.shape and got.stride() == like.stride()
    assert (out[1, :, :2] == 0).all() and (grads[0][1, :, 11:] == 0).all()


def test_the_packed_kernels_serve_where_the_flash_kernel_does_and_never_attending_padding(monkeypatch):
    from hf_memo.runtime import varlen_attention
    from hf_memo.runtime.varlen_attention import PackedKernels, packed_kernels_for

    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    packed, padded = BatchLayout(8, (((0, 3), (3, 8)),)), BatchLayout(8, (((0, 3),),), padding_attends=True)
    assert packed_kernels_for(q, q, packed, TRAITS) is None  # CPU: per-sample calls
    chosen = []

    def flash(t, traits, value_head_dim):
        chosen.append((t.dtype, value_head_dim))
        return "cuda-flash"

    monkeypatch.setattr(varlen_attention, "backend_for", flash)
    assert packed_kernels_for(q, q, packed, AttentionTraits(0.3, 0.1, window=2)) is PackedKernels
    assert chosen == [(torch.bfloat16, 64)]
    assert packed_kernels_for(q, q, padded, TRAITS) is None  # padding attending over its sample: per-block calls
    assert packed_kernels_for(q, q, packed, AttentionTraits(0.3, softcap=5.0)) is None  # PyTorch's: no softcap
    monkeypatch.setattr(varlen_attention, "backend_for", lambda t, traits, value_head_dim: "cuda-efficient")
    assert packed_kernels_for(q, q, packed, TRAITS) is None


def _sample_window_mask(rows, length, window):
    """Additive ``(B, 1, S, S)`` mask: causal within each sample of ``rows`` and inside the window; -inf elsewhere."""
    visible = torch.zeros(len(rows), 1, length, length, dtype=torch.bool)
    i, j = torch.arange(length)[:, None], torch.arange(length)
    for row, spans in enumerate(rows):
        for start, stop in spans:
            inside = (i >= start) & (i < stop) & (j >= start) & (j <= i) & (j > i - window)
            visible[row, 0] |= inside
    return torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, -torch.inf)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_window_and_sinks_apply_within_each_sample(kv_heads):
    """gpt-oss's eager attention on whole rows with a block-diagonal sliding mask: the window counts from each
    sample's own tokens, padding queries give zeros (their sink takes all the weight), the sinks' gradient sums
    over the samples."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 13, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, kv_heads, 13, 8, dtype=torch.float64, generator=gen) for _ in "kv")
    sinks, grad_out = torch.randn(4, dtype=torch.float64, generator=gen), torch.randn_like(q)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    module = type("Attention", (), {"num_key_value_groups": 4 // kv_heads, "training": False, "sinks": leaves[3]})
    want, _ = eager_attention_forward(module, *leaves[:3], _sample_window_mask(ROWS, 13, 3), 0.3)
    want.backward(grad_out.transpose(1, 2))
    traits = AttentionTraits(0.3, window=3, sinks=sinks)
    core = VarlenAttention(BatchLayout(13, ROWS))
    out, stats = core.forward(q, k, v, traits)
    grads = core.backward(grad_out, q, k, v, out, stats, traits)
    torch.testing.assert_close(out.transpose(1, 2), want.detach(), rtol=1e-12, atol=1e-12)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_packed_kernel_gets_the_window_and_sinks_compose_with_it(kv_heads):
    """PyTorch's varlen flash kernel (stood in on the CPU) with the window (w - 1, 0) inside each sample and the
    sinks composed with its packed (out, lse): equal to the per-sample path."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 13, 4, 8, dtype=torch.float64, generator=gen).transpose(1, 2)
    k, v = (torch.randn(2, 13, kv_heads, 8, dtype=torch.float64, generator=gen).transpose(1, 2) for _ in "kv")
    grad_out = torch.randn(2, 4, 13, 8, dtype=torch.float64, generator=gen)
    traits = AttentionTraits(0.3, window=4, sinks=torch.randn(4, dtype=torch.float64, generator=gen))
    layout = BatchLayout(13, ROWS)
    with TorchFlashOnCpu() as flash:
        packed = VarlenAttention(layout, packed=PackedKernels)
        out, stats = packed.forward(q, k, v, traits)
        grads = packed.backward(grad_out, q, k, v, out, stats, traits)
    assert [(call["window_size_left"], call["window_size_right"]) for _, call in flash.calls] == [(3, 0), (3, 0)]
    per_sample = VarlenAttention(layout)
    want_out, want_stats = per_sample.forward(q, k, v, traits)
    want_grads = per_sample.backward(grad_out, q, k, v, want_out, want_stats, traits)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_window_over_padding_that_attends_is_none_within_its_reach_and_refused_beyond():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64, generator=gen) for _ in "qkv")
    layout = BatchLayout(9, (((2, 6),),), padding_attends=True)  # padding 6..8 attends to tokens 2..5: reach 7
    plain, _ = VarlenAttention(layout).forward(q, k, v, AttentionTraits(0.3))
    windowed, _ = VarlenAttention(layout).forward(q, k, v, AttentionTraits(0.3, window=7))
    assert torch.equal(windowed, plain)
    with pytest.raises(ValueError, match="sliding window of 6 tokens and padding with targets .* over 7 tokens"):
        VarlenAttention(layout).forward(q, k, v, AttentionTraits(0.3, window=6))


def test_the_packed_path_builds_its_token_index_once_for_a_forward_and_its_backward(monkeypatch):
    """The samples' token index and starts are built on the host once per layer call (not again in backward), so a
    CUDA step copies them once, from pinned memory, without the host waiting."""
    built = []
    spans = BatchLayout.spans
    monkeypatch.setattr(BatchLayout, "spans", lambda self, batch: built.append(batch) or spans(self, batch))
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 13, 4, 8, dtype=torch.float64, generator=gen).transpose(1, 2)
    k, v = (torch.randn(2, 13, 2, 8, dtype=torch.float64, generator=gen).transpose(1, 2) for _ in "kv")
    packed = VarlenAttention(BatchLayout(13, ROWS), packed=CountingCpuPackedKernels)
    out, stats = packed.forward(q, k, v, TRAITS)
    packed.backward(torch.ones_like(out), q, k, v, out, stats, TRAITS)
    assert built == [2]
