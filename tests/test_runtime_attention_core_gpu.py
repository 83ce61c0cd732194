"""The attention core's CUDA backends (GPU only): values and gradients against SDPA autograd, output layout, K/V
reaching the flash kernels unexpanded, and dropout masks replayed from the kernels' Philox seed/offset (the same
kernel under SDPA with the same device RNG state draws the same mask)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import hf_memo
from hf_memo.runtime import flash_attn_package
from hf_memo.runtime.attention_core import attention_backward, attention_forward, backend_for
from hf_memo.runtime.attention_traits import AttentionTraits
from tests.conftest import build_model, make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA attention kernels need a GPU")

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-4}
KERNEL = {"cuda-flash": SDPBackend.FLASH_ATTENTION, "cuda-efficient": SDPBackend.EFFICIENT_ATTENTION}
PLAIN = AttentionTraits(0.125)


@pytest.fixture
def torch_kernels(monkeypatch):
    """PyTorch's CUDA kernels even where flash-attn is installed (it has its own test below)."""
    monkeypatch.setattr(flash_attn_package, "flash_attn_interface", lambda: None)


def _inputs(dtype, heads, kv_heads, seq=300, dim=64, batch=2):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seq, heads, dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
    kv_shape = (batch, seq, kv_heads, dim)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=dtype, generator=gen).transpose(1, 2) for _ in "kv")
    upstream = torch.randn(batch, seq, heads, dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
    return q, k, v, upstream


def _sdpa(q, k, v, upstream, dropout_p, kernel=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with sdpa_kernel(kernel) if kernel is not None else torch.enable_grad():
        out = F.scaled_dot_product_attention(
            *leaves, is_causal=True, dropout_p=dropout_p, scale=0.125, enable_gqa=q.shape[1] != k.shape[1]
        )
    out.backward(upstream)
    return out.detach(), [t.grad for t in leaves]


def _close(got, want, dtype):
    error = ((got.float() - want.float()).abs().max() / (want.float().abs().max() + 1e-6)).item()
    assert error < TOLERANCE[dtype], error


class _FlashCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kv_heads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention.default:
            self.kv_heads.append(args[1].shape[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_values_gradients_and_layout_against_sdpa(torch_kernels, dtype, kv_heads):
    q, k, v, upstream = _inputs(dtype, 4, kv_heads)
    with _FlashCalls() as calls:
        out, stats = attention_forward(q, k, v, PLAIN)
    dq, dk, dv, _ = attention_backward(upstream, q, k, v, out, stats, PLAIN)
    want, grads = _sdpa(q, k, v, upstream, 0.0)
    assert out.transpose(1, 2).is_contiguous()  # (B, S, h, D) memory: the executor's rows are views
    if backend_for(q, PLAIN) == "cuda-flash":
        assert calls.kv_heads == [kv_heads]  # grouped K/V not expanded for the flash kernel
    for got, ref in zip((out, dq, dk, dv), (want, *grads)):
        assert got.shape == ref.shape
        _close(got, ref, dtype)


@pytest.mark.parametrize("dtype,kv_heads", [(torch.bfloat16, 1), (torch.bfloat16, 4), (torch.float32, 4)])
def test_dropout_mask_is_the_kernels_and_is_replayed_in_backward(torch_kernels, dtype, kv_heads):
    """Same device RNG state, same kernel: SDPA with dropout draws the mask the core drew; the core's backward
    (from the kept seed/offset) must then give SDPA's gradients. The efficient kernel needs equal head counts
    under SDPA, so it is checked without grouping."""
    q, k, v, upstream = _inputs(dtype, 4, kv_heads)
    traits = AttentionTraits(0.125, 0.2)
    backend = backend_for(q, traits)
    torch.cuda.manual_seed(7)
    out, stats = attention_forward(q, k, v, traits)
    dq, dk, dv, _ = attention_backward(upstream, q, k, v, out, stats, traits)
    torch.cuda.manual_seed(7)
    want, grads = _sdpa(q, k, v, upstream, 0.2, KERNEL[backend])
    assert stats.dropout_p == 0.2
    for got, ref in zip((out, dq, dk, dv), (want, *grads)):
        _close(got, ref, dtype)
    torch.cuda.manual_seed(8)
    other, _ = _sdpa(q, k, v, upstream, 0.2, KERNEL[backend])
    assert (other.float() - out.float()).abs().max() > 10 * TOLERANCE[dtype] * out.float().abs().max()


@pytest.mark.skipif(flash_attn_package.flash_attn_interface() is None, reason="flash-attn 2.7/2.8 not installed")
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_flash_attn_backend_against_flash_attn_func(dropout_p):
    from flash_attn import flash_attn_func

    q, k, v, upstream = _inputs(torch.bfloat16, 4, 1)
    traits = AttentionTraits(0.125, dropout_p)
    assert backend_for(q, traits) == "flash-attn"
    torch.cuda.manual_seed(3)
    out, stats = attention_forward(q, k, v, traits)
    grads = attention_backward(upstream, q, k, v, out, stats, traits)[:3]
    leaves = [t.detach().transpose(1, 2).clone().requires_grad_(True) for t in (q, k, v)]
    torch.cuda.manual_seed(3)
    want = flash_attn_func(*leaves, dropout_p=dropout_p, softmax_scale=0.125, causal=True)
    want.backward(upstream.transpose(1, 2))
    _close(out, want.transpose(1, 2), torch.bfloat16)
    for got, leaf in zip(grads, leaves):
        _close(got, leaf.grad.transpose(1, 2), torch.bfloat16)


def _relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_memo_with_attention_dropout_tracks_unpatched_sdpa_on_the_gpu(torch_kernels):
    """bf16 Llama (GQA) with attention dropout: memo draws its masks from the device RNG in the same order and with
    the same flash kernel as transformers' SDPA, so loss and gradients agree to bf16 precision; a different seed
    (another mask) moves them much further."""
    model = build_model("llama", dtype=torch.bfloat16, num_hidden_layers=3, attention_dropout=0.2).cuda()
    reference = copy.deepcopy(model)
    hf_memo.apply(model, recompute="memo", offload_fraction=0.5, mlp_chunks=4)
    ids, labels = (t.cuda() for t in make_batch(2, 64))
    results = []
    for net, seed in ((model, 1), (reference, 1), (reference, 2)):
        net.zero_grad()
        torch.cuda.manual_seed(seed)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            loss = net(input_ids=ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in net.parameters()]))
    (memo_loss, memo_grads), (ref_loss, ref_grads), (other_loss, other_grads) = results
    same = max(_relative(g, r) for g, r in zip(memo_grads, ref_grads))
    different = max(_relative(g, r) for g, r in zip(other_grads, ref_grads))
    assert same < 0.1 * different and same < 5e-2, (same, different)
    assert abs(memo_loss - ref_loss) < 0.1 * abs(other_loss - ref_loss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_non_causal_blocks_of_other_key_lengths_against_sdpa(torch_kernels, dtype, kv_heads):
    """``causal=False`` with fewer queries than keys (the trained padding after a sample over its tokens)."""
    q, _, _, upstream = _inputs(dtype, 4, kv_heads, seq=70)
    _, k, v, _ = _inputs(dtype, 4, kv_heads, seq=230)
    out, stats = attention_forward(q, k, v, PLAIN, causal=False)
    dq, dk, dv, _ = attention_backward(upstream, q, k, v, out, stats, PLAIN, causal=False)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, scale=0.125, enable_gqa=kv_heads != 4)
    want.backward(upstream)
    for got, ref in zip((out, dq, dk, dv), (want.detach(), *(t.grad for t in leaves))):
        assert got.shape == ref.shape
        _close(got, ref, dtype)


def _explicit_fp64(q, k, v, upstream, traits):
    """The explicit kernel in fp64 on the same device: the reference for the kernels' traits."""
    wide = [t.double() for t in (q, k, v, upstream)]
    sinks = None if traits.sinks is None else traits.sinks.double()
    wide_traits = AttentionTraits(traits.scale, traits.dropout_p, traits.window, traits.softcap, sinks)
    out, stats = attention_forward(*wide[:3], wide_traits)
    return out, attention_backward(wide[3], *wide[:3], out, stats, wide_traits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window,softcap,sinks", [(64, None, False), (None, 30.0, False), (64, 30.0, True)])
def test_traits_on_the_gpu_against_the_explicit_kernel_in_fp64(dtype, window, softcap, sinks):
    """A window on PyTorch's flash kernel (bf16) or the explicit one (fp32), soft-capping on flash-attn or the
    explicit kernel, sinks composed with either: values and gradients (the sinks' included) against fp64."""
    q, k, v, upstream = _inputs(dtype, 4, 2)
    sink_logits = torch.randn(4, device="cuda") if sinks else None
    traits = AttentionTraits(0.125, 0.0, window, softcap, sink_logits)
    out, stats = attention_forward(q, k, v, traits)
    grads = attention_backward(upstream, q, k, v, out, stats, traits)
    want_out, want_grads = _explicit_fp64(q, k, v, upstream, traits)
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    for got, want in zip((out, *grads), (want_out, *want_grads)):
        if want is not None:
            _close(got, want, dtype)
    assert (grads[3] is None) == (not sinks)
