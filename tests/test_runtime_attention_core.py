import inspect

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hf_memo.profiler import kernel_workspace
from hf_memo.profiler.kernel_workspace import CUDA, PROFILED_TARGET, KernelTarget, cpu_flash_takes_grouped_kv
from hf_memo.runtime import attention_core, flash_attn_package
from hf_memo.runtime.attention_core import (
    attention_backward,
    attention_forward,
    backend_for,
    expand_kv,
    kernel_window,
    needs_kv_expansion,
    reduce_kv,
    select_backend,
)
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.dropout_attention import keep_mask
from tests.torch_flash_stand_in import TorchFlashOnCpu


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
    out, stats = attention_forward(q.detach(), k.detach(), v.detach(), AttentionTraits(0.3))
    assert not out.requires_grad and stats.lse.shape == (2, heads, seq)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    dq, dk, dv, dsinks = attention_backward(
        upstream, q.detach(), k.detach(), v.detach(), out, stats, AttentionTraits(0.3)
    )
    assert dsinks is None
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
    assert backend_for(torch.empty(1, 1, 1, 1), AttentionTraits(1.0)) == "cpu-flash"
    with pytest.raises(ValueError, match="supports cpu and cuda"):
        backend_for(torch.empty(1, 1, 1, 1, device="meta"), AttentionTraits(1.0))


class _KernelArgs(TorchDispatchMode):
    """Records the shapes of the tensors each ``op`` in ``ops`` is called with."""

    def __init__(self, *ops):
        super().__init__()
        self.calls = {op: [] for op in ops}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.calls:
            self.calls[func].append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_grouped_kv_reach_the_cpu_kernels_unexpanded_and_gradients_stay_exact(dropout_p):
    """A CPU flash kernel that takes h_kv < h (its probe says so; every release in the tested range does) and the
    dropout path get K/V unexpanded: they are not copied per query head."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 21, 6, 8, dtype=torch.float64, generator=gen).transpose(1, 2)  # as the executor lays it out
    k, v = (torch.randn(2, 21, 2, 8, dtype=torch.float64, generator=gen).transpose(1, 2) for _ in range(2))
    upstream = torch.randn(2, 6, 21, 8, dtype=torch.float64, generator=gen)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    with _KernelArgs(flash, flash_backward) as recorded:
        out, stats = attention_forward(q, k, v, AttentionTraits(0.3, dropout_p))
        dq, dk, dv, _ = attention_backward(upstream, q, k, v, out, stats, AttentionTraits(0.3, dropout_p))
    if dropout_p == 0:
        kv_shape = k.shape if cpu_flash_takes_grouped_kv() else q.shape  # else expanded to every query head
        assert recorded.calls[flash] == [[q.shape, kv_shape, kv_shape]]
        assert recorded.calls[flash_backward][0][2:4] == [kv_shape, kv_shape]
        keep = torch.ones(2, 6, 21, 21, dtype=torch.bool)
    else:
        assert recorded.calls == {flash: [], flash_backward: []}
        assert stats.dropout_p == dropout_p
        keep = keep_mask(stats.extra[0], dropout_p, 2, 6, 21, (0, 21), 21, q.device)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    scores = leaves[0] @ expand_kv(leaves[1], 3).transpose(-1, -2) * 0.3
    scores = scores.masked_fill(~torch.ones(21, 21, dtype=torch.bool).tril(), float("-inf"))
    want = (scores.softmax(-1) * keep / (1 - dropout_p)) @ expand_kv(leaves[2], 3)
    want.backward(upstream)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_output_is_laid_out_like_the_queries(dropout_p):
    """From q/k/v views of (B, S, h, D) memory the output comes back the same way: its rows are a view."""
    q, k, v = (torch.randn(2, 9, 4, 8).transpose(1, 2) for _ in range(3))
    out, _ = attention_forward(q, k, v, AttentionTraits(0.3, dropout_p))
    assert out.shape == (2, 4, 9, 8) and out.transpose(1, 2).is_contiguous()


def test_dropout_masks_follow_the_cpu_generator():
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(5)
    traits = AttentionTraits(0.3, 0.5)
    first, _ = attention_forward(q, k, v, traits)
    second, _ = attention_forward(q, k, v, traits)
    torch.manual_seed(5)
    again, _ = attention_forward(q, k, v, traits)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_backend_selection_and_which_kernels_need_kv_expansion(monkeypatch):
    monkeypatch.setattr(flash_attn_package, "flash_attn_interface", lambda: None)
    assert select_backend("cpu", torch.float32, 64) == "cpu-flash"
    assert select_backend("cpu", torch.bfloat16, 64, dropout_p=0.1) == "explicit"
    assert select_backend("cuda", torch.bfloat16, 128, capability=(9, 0)) == "cuda-flash"
    assert select_backend("cuda", torch.float16, 64, dropout_p=0.1, capability=(8, 0)) == "cuda-flash"
    # flash-attn refuses a soft-cap with dropout (Gemma-2 with attention dropout), PyTorch's kernels have no soft-cap
    assert select_backend("cuda", torch.bfloat16, 128, 0.1, (9, 0), softcapped=True, flash_attn=True) == "explicit"
    assert select_backend("cuda", torch.bfloat16, 128, 0.0, (9, 0), softcapped=True, flash_attn=True) == "flash-attn"
    assert select_backend("cuda", torch.float32, 128, capability=(9, 0)) == "cuda-efficient"
    assert select_backend("cuda", torch.bfloat16, 12, capability=(9, 0)) == "cuda-efficient"  # head size
    assert select_backend("cuda", torch.bfloat16, 512, capability=(9, 0)) == "cuda-efficient"
    assert select_backend("cuda", torch.float16, 64, capability=(7, 5)) == "cuda-efficient"  # pre-Ampere
    monkeypatch.setattr(flash_attn_package, "flash_attn_interface", lambda: object())
    assert select_backend("cuda", torch.bfloat16, 128, capability=(9, 0)) == "flash-attn"
    assert select_backend("cuda", torch.float32, 128, capability=(9, 0)) == "cuda-efficient"
    assert [needs_kv_expansion(b) for b in ("explicit", "flash-attn", "cuda-flash", "cuda-efficient")] == [
        False,
        False,
        False,
        True,
    ]
    # the CPU flash kernel: as the probe of this PyTorch finds, and expanded for one that refuses grouped K/V
    assert needs_kv_expansion("cpu-flash") == (not cpu_flash_takes_grouped_kv())
    monkeypatch.setattr(kernel_workspace, "cpu_flash_takes_grouped_kv", lambda: False)
    assert needs_kv_expansion("cpu-flash")


def test_the_grouped_kv_probe_runs_real_kernels_outside_the_active_modes_and_a_refusal_is_a_no(monkeypatch):
    """The probe may first run inside a fake profile or a recorder: it answers as outside them and records nothing."""
    probe = inspect.unwrap(cpu_flash_takes_grouped_kv)  # uncached
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with FakeTensorMode(), _KernelArgs(flash) as recorded:
        assert probe() == cpu_flash_takes_grouped_kv()
    assert recorded.calls == {flash: []}

    def refuse(*args, **kwargs):
        raise RuntimeError("number of heads in key/value must equal the number of heads in query")

    monkeypatch.setattr(kernel_workspace, "_FORWARD", refuse)
    assert not probe()


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("queries,keys", [(3, 5), (6, 2)])
def test_non_causal_blocks_attend_every_query_to_every_key(dropout_p, queries, keys):
    """``causal=False`` (the padding queries after a sample over its keys): q and k may differ in length."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, queries, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, keys, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in "kv")
    upstream = torch.randn(2, 4, queries, 8, dtype=torch.float64, generator=gen)
    torch.manual_seed(9)
    traits = AttentionTraits(0.3, dropout_p)
    out, stats = attention_forward(q.detach(), k.detach(), v.detach(), traits, causal=False)
    probs = (q @ expand_kv(k, 2).transpose(-1, -2) * 0.3).softmax(-1)
    if dropout_p:
        (seed,) = stats.extra
        length = max(queries, keys)
        probs = probs * keep_mask(seed, dropout_p, 2, 4, length, (0, queries), keys, q.device) / (1 - dropout_p)
    want = probs @ expand_kv(v, 2)
    want.backward(upstream)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    grads = attention_backward(upstream, q.detach(), k.detach(), v.detach(), out, stats, traits, causal=False)
    for got, leaf in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)


def test_traits_choose_a_kernel_that_computes_them(monkeypatch):
    """A window needs the explicit path on the CPU and outside the flash kernels' dtypes, soft-capping also on CUDA
    without flash-attn; sinks never decide (composed with any kernel); a window that hides nothing is none."""
    monkeypatch.setattr(flash_attn_package, "flash_attn_interface", lambda: None)
    flash = {"dtype": torch.bfloat16, "head_dim": 128, "capability": (9, 0)}
    assert select_backend("cpu", torch.float32, 64, windowed=True) == "explicit"
    assert select_backend("cpu", torch.float32, 64, softcapped=True) == "explicit"
    assert select_backend("cuda", **flash, windowed=True) == "cuda-flash"
    assert select_backend("cuda", **flash, softcapped=True) == "explicit"
    assert select_backend("cuda", torch.float32, 128, capability=(9, 0), windowed=True) == "explicit"
    monkeypatch.setattr(flash_attn_package, "flash_attn_interface", lambda: object())
    assert select_backend("cuda", **flash, windowed=True, softcapped=True) == "flash-attn"
    q = torch.empty(1, 2, 10, 8)
    assert kernel_window(AttentionTraits(1.0, window=9), 10) == 9
    assert kernel_window(AttentionTraits(1.0, window=10), 10) is None
    assert backend_for(q, AttentionTraits(1.0, window=10, sinks=torch.zeros(2))) == "cpu-flash"
    assert backend_for(q, AttentionTraits(1.0, window=9)) == "explicit"
    with pytest.raises(ValueError, match="needs causal"):
        kernel_window(AttentionTraits(1.0, window=3), 10, causal=False)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_window_reaches_pytorchs_cuda_flash_kernel_and_sinks_compose_with_it(monkeypatch, kv_heads):
    """The windowed CUDA flash path (its kernel stood in on the CPU): (B, S, h, D) views, window (w - 1, 0), the
    sinks composed with its (out, lse) and its backward run on them; results equal the explicit path's."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 13, 4, 8, dtype=torch.float64, generator=gen).transpose(1, 2)
    k, v = (torch.randn(2, 13, kv_heads, 8, dtype=torch.float64, generator=gen).transpose(1, 2) for _ in "kv")
    upstream = torch.randn(2, 4, 13, 8, dtype=torch.float64, generator=gen)
    traits = AttentionTraits(0.3, window=5, sinks=torch.randn(4, dtype=torch.float64, generator=gen))
    want_out, want_stats = attention_forward(q, k, v, traits)
    want = attention_backward(upstream, q, k, v, want_out, want_stats, traits)
    monkeypatch.setattr(attention_core, "backend_for", lambda q, traits, causal=True, value_head_dim=None: "cuda-flash")
    with TorchFlashOnCpu() as flash:
        out, stats = attention_forward(q, k, v, traits)
        grads = attention_backward(upstream, q, k, v, out, stats, traits)
    (_, forward), (_, backward) = flash.calls
    for call in (forward, backward):
        assert (call["window_size_left"], call["window_size_right"], call["cum_seq_q"]) == (4, 0, None)
        assert call["query"].shape == (2, 13, 4, 8) and call["key"].shape == (2, 13, kv_heads, 8)
    assert backward["logsumexp"] is stats.lse and out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_fake_profile_for_a_cuda_target_stands_in_the_kernel_the_target_would_run():
    """A windowed or soft-capped layer profiled for a GPU: the CPU flash op stands in for the flash kernel that takes
    the traits (the recorder adds its workspace); the explicit kernel runs only where the target would run it."""
    windowed = AttentionTraits(0.125, window=8)
    capped = AttentionTraits(0.125, softcap=30.0)
    with FakeTensorMode():
        q = torch.empty(1, 4, 64, 64, dtype=torch.bfloat16)
    real = torch.empty(1, 4, 64, 64, dtype=torch.bfloat16)
    assert backend_for(q, windowed) == backend_for(real, windowed) == "explicit"  # no target: the CPU's rule
    token = PROFILED_TARGET.set(CUDA)
    try:
        assert backend_for(q, windowed) == backend_for(q, capped) == "cpu-flash"  # flash-attn takes both
        assert backend_for(real, windowed) == "explicit"  # a real CPU tensor runs the CPU's kernel
        PROFILED_TARGET.set(KernelTarget(flash_attn=False))  # PyTorch's flash kernel: a window, no soft-cap
        assert (backend_for(q, windowed), backend_for(q, capped)) == ("cpu-flash", "explicit")
    finally:
        PROFILED_TARGET.reset(token)
