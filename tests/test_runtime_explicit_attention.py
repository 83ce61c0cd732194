"""Attention with traits (sliding window, soft-capping, sinks, dropout): the explicit kernel against autograd through
written-out math, and the attention core against transformers' own eager implementations (Gemma 2, gpt-oss) with
transformers' masks, forward and backward (the sinks' gradient included), in fp64."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from hf_memo.runtime import explicit_attention
from hf_memo.runtime.attention_core import attention_backward, attention_forward, backend_for, expand_kv
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.dropout_attention import keep_mask
from hf_memo.runtime.explicit_attention import explicit_backward, explicit_forward

CPU = torch.device("cpu")


def _inputs(seed, heads, kv_heads, seq, keys=None, dim=8):
    """q as a (B, h, S, D) view of (B, S, h, D) memory (the executor's layout), k, v, the output's gradient."""
    gen = torch.Generator().manual_seed(seed)
    keys = seq if keys is None else keys
    q = torch.randn(2, seq, heads, dim, dtype=torch.float64, generator=gen).transpose(1, 2)
    k, v = (torch.randn(2, keys, kv_heads, dim, dtype=torch.float64, generator=gen).transpose(1, 2) for _ in "kv")
    return q, k, v, torch.randn(2, heads, seq, dim, dtype=torch.float64, generator=gen)


def _reference(q, k, v, traits, keep=None, causal=True):
    """Attention with ``traits`` written out on the whole (S, S_k) score matrix (autograd differentiates it)."""
    groups = q.shape[1] // k.shape[1]
    scores = q @ expand_kv(k, groups).transpose(-1, -2) * traits.scale
    if traits.softcap is not None:
        scores = traits.softcap * torch.tanh(scores / traits.softcap)
    if causal:
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])
        visible = (j <= i) & ((j > i - traits.window) if traits.window is not None else True)
        scores = scores.masked_fill(~visible, -torch.inf)
    if traits.sinks is not None:
        sink = traits.sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    if keep is not None:
        probs = probs * keep / (1 - traits.dropout_p)
    return probs @ expand_kv(v, groups)


def _assert_gradients(got, leaves):
    for grad, leaf in zip(got, leaves):
        assert grad.shape == leaf.shape
        torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("seq,window", [(1, 3), (13, 3), (13, 13), (13, 40), (40, 7), (40, None)])
@pytest.mark.parametrize("softcap,p", [(None, 0.0), (2.0, 0.0), (None, 0.3), (1.5, 0.3)])
def test_explicit_pair_equals_autograd_through_written_out_math(monkeypatch, heads, kv_heads, seq, window, softcap, p):
    """Blocks of a few rows (the block budget cut to 60 scores per head), rows not dividing S, windows shorter than,
    equal to and longer than S; dropout's mask regenerated in backward from the seed alone."""
    monkeypatch.setattr(explicit_attention, "BLOCK_ELEMENTS", 60 * 2 * heads)
    q, k, v, upstream = _inputs(0, heads, kv_heads, seq)
    traits, seed = AttentionTraits(0.35, p, window, softcap), 1234
    keep = keep_mask(seed, p, 2, heads, seq, (0, seq), seq, CPU) if p else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = _reference(*leaves, traits, keep)
    want.backward(upstream)

    out, lse = explicit_forward(q, k, v, traits, seed)
    assert out.stride() == q.stride() and lse.shape == (2, heads, seq)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    _assert_gradients(explicit_backward(upstream, q, k, v, out, lse, traits, seed), leaves)


@pytest.mark.parametrize("softcap,p", [(None, 0.25), (2.0, 0.0), (2.0, 0.25)])
@pytest.mark.parametrize("queries,keys", [(3, 5), (6, 2)])
def test_non_causal_blocks_attend_every_query_to_every_key(softcap, p, queries, keys):
    """``causal=False`` (padding queries over their sample's keys): q and k may differ in length."""
    q, k, v, upstream = _inputs(4, 4, 2, queries, keys)
    traits, seed = AttentionTraits(0.3, p, None, softcap), 77
    keep = keep_mask(seed, p, 2, 4, max(queries, keys), (0, queries), keys, CPU) if p else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = _reference(*leaves, traits, keep, causal=False)
    want.backward(upstream)
    out, lse = explicit_forward(q, k, v, traits, seed, causal=False)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    _assert_gradients(explicit_backward(upstream, q, k, v, out, lse, traits, seed, causal=False), leaves)


def test_the_explicit_kernel_refuses_what_it_does_not_compute():
    q, k, v, _ = _inputs(0, 2, 2, 4)
    with pytest.raises(ValueError, match="no sinks"):
        explicit_forward(q, k, v, AttentionTraits(0.3, sinks=torch.zeros(2, dtype=torch.float64)))
    with pytest.raises(ValueError, match="needs causal"):
        explicit_forward(q, k, v, AttentionTraits(0.3, window=2), causal=False)


class _ScoreWidths(TorchDispatchMode):
    """The widest key span of any batched matmul whose output has more than ``dim`` columns (the scores)."""

    def __init__(self, dim):
        super().__init__()
        self.dim, self.widest, self.calls = dim, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bmm.default:
            self.calls += 1
            if out.shape[-1] != self.dim:
                self.widest = max(self.widest, out.shape[-1])
        return out


def test_a_window_reads_only_its_band_of_keys(monkeypatch):
    """With a window each block of queries reads at most ``rows + window - 1`` keys: cost O(S * window), not S^2."""
    monkeypatch.setattr(explicit_attention, "BLOCK_ELEMENTS", 2 * 2 * 8 * (8 + 4))  # 8 rows per block
    q, k, v, upstream = _inputs(1, 2, 2, 64)
    traits = AttentionTraits(0.3, window=5)
    with _ScoreWidths(dim=8) as recorded:
        out, lse = explicit_forward(q, k, v, traits)
        explicit_backward(upstream, q, k, v, out, lse, traits)
    assert recorded.calls > 8 and 8 <= recorded.widest <= 8 + 5 - 1


def test_reduced_precision_inputs_are_computed_in_float32():
    q, k, v, _ = (t.float() for t in _inputs(1, 2, 2, 9))
    traits = AttentionTraits(0.3, 0.1, 4, 3.0)
    out, lse = explicit_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), traits, 5)
    want, want_lse = explicit_forward(*(t.bfloat16().float() for t in (q, k, v)), traits, 5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, want.bfloat16())
    torch.testing.assert_close(lse, want_lse)


class _Module:
    """What transformers' eager attention functions read from the attention module."""

    def __init__(self, groups, sinks=None):
        self.num_key_value_groups, self.training, self.head_dim, self.sinks = groups, False, 8, sinks


def _transformers_mask(seq, window):
    function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return eager_mask(batch_size=2, q_length=seq, kv_length=seq, mask_function=function, dtype=torch.float64)


def _core(q, k, v, upstream, traits):
    out, stats = attention_forward(q, k, v, traits)
    return out, attention_backward(upstream, q, k, v, out, stats, traits)


SHAPES = [(4, 4, 13, 5), (4, 2, 13, 13), (6, 2, 21, 4), (6, 1, 21, 30), (4, 2, 17, None)]


@pytest.mark.parametrize("heads,kv_heads,seq,window", SHAPES)
def test_the_core_computes_gpt_oss_eager_attention_with_sinks_and_its_sinks_gradient(heads, kv_heads, seq, window):
    """gpt-oss: sinks (and a window on its sliding layers); the core composes the sinks with its kernel (the CPU flash
    kernel without a window, the explicit one with)."""
    q, k, v, upstream = _inputs(2, heads, kv_heads, seq)
    sinks = torch.randn(heads, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    want, _ = gpt_oss_eager(_Module(heads // kv_heads, leaves[3]), *leaves[:3], _transformers_mask(seq, window), 0.3)
    want.backward(upstream.transpose(1, 2))
    traits = AttentionTraits(0.3, window=window, sinks=sinks)
    out, grads = _core(q, k, v, upstream, traits)
    torch.testing.assert_close(out.transpose(1, 2), want.detach(), rtol=1e-12, atol=1e-12)
    _assert_gradients(grads, leaves)
    assert backend_for(q, traits) == ("cpu-flash" if window is None or window >= seq else "explicit")


@pytest.mark.parametrize("heads,kv_heads,seq,window", SHAPES)
def test_the_core_computes_gemma2_eager_attention_with_softcap(monkeypatch, heads, kv_heads, seq, window):
    """Gemma 2: soft-capped scores, a window on its sliding layers. Its eager softmax runs in fp32 (hence the
    tolerance); blocks of a few rows."""
    monkeypatch.setattr(explicit_attention, "BLOCK_ELEMENTS", 2 * heads * 40)
    q, k, v, upstream = _inputs(5, heads, kv_heads, seq)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    module = _Module(heads // kv_heads)
    want, _ = gemma2_eager(module, *leaves, _transformers_mask(seq, window), scaling=0.3, softcap=1.5)
    want.backward(upstream.transpose(1, 2))
    out, (dq, dk, dv, dsinks) = _core(q, k, v, upstream, AttentionTraits(0.3, window=window, softcap=1.5))
    assert dsinks is None
    torch.testing.assert_close(out.transpose(1, 2), want.detach(), rtol=1e-6, atol=1e-6)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_the_core_composes_every_trait_at_once(p):
    """Window, soft-cap, sinks and dropout together, against the written-out math with the forward's mask."""
    q, k, v, upstream = _inputs(6, 6, 2, 19)
    sinks = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    traits = AttentionTraits(0.3, p, 6, 2.5, sinks)
    torch.manual_seed(0)
    out, stats = attention_forward(q, k, v, traits)
    keep = keep_mask(stats.extra[0], p, 2, 6, 19, (0, 19), 19, CPU) if p else None
    want = _reference(*leaves[:3], AttentionTraits(0.3, p, 6, 2.5, leaves[3]), keep)
    want.backward(upstream)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    _assert_gradients(attention_backward(upstream, q, k, v, out, stats, traits), leaves)


def test_the_explicit_path_runs_under_fake_tensors():
    """Memory profiles run the step under FakeTensorMode: the explicit kernel and the sinks are plain torch ops."""
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 40, h, 8, dtype=torch.bfloat16).transpose(1, 2) for h in (4, 2, 2))
        traits = AttentionTraits(0.3, 0.1, 8, 2.0, torch.zeros(4))
        out, stats = attention_forward(q, k, v, traits)
        grads = attention_backward(out, q, k, v, out, stats, traits)
    assert out.shape == q.shape and stats.lse.shape == (2, 4, 40)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, (4,)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_values_of_another_head_size_go_to_the_explicit_kernel_and_equal_the_written_out_math(heads, kv_heads):
    """Values twice as wide as the queries and keys (DiffLlama's two value halves side by side): the CPU flash
    kernel needs equal head sizes, so the explicit kernel computes them; output and gradients are the math's."""
    q, k, _, _ = _inputs(3, heads, kv_heads, 11)
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(2, 11, kv_heads, 16, dtype=torch.float64, generator=gen).transpose(1, 2)
    upstream = torch.randn(2, heads, 11, 16, dtype=torch.float64, generator=gen)
    traits = AttentionTraits(0.35)
    assert backend_for(q, traits, value_head_dim=16) == "explicit" and backend_for(q, traits) == "cpu-flash"
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = _reference(*leaves, traits)
    want.backward(upstream)
    out, stats = attention_forward(q, k, v, traits)
    assert out.shape == (2, heads, 11, 16)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    _assert_gradients(attention_backward(upstream, q, k, v, out, stats, traits)[:3], leaves)
