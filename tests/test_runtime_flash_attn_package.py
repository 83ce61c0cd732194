"""The flash-attn backend on the CPU, through fake ``flash_attn`` packages written to a temporary folder: one
whose extension fails to load, one of an unsupported version, and one with flash-attn 2.7/2.8's interface
implemented with torch math (recording every call)."""

import sys
import textwrap
import warnings

import pytest
import torch

from hf_memo.runtime import attention_core, flash_attn_package
from hf_memo.runtime.attention_core import attention_backward, attention_forward, expand_kv
from hf_memo.runtime.attention_traits import AttentionTraits

# flash-attn 2.7.0 .. 2.8.3's private functions, same names and parameters, computed with torch math. The
# dropout mask is drawn from a generator seeded by ``rng_state``, as the CUDA kernel replays Philox from it.
FAKE_INTERFACE = '''
import torch

CALLS = []


def _attention(q, k, v, dropout_p, softmax_scale, rng_state, window_size_left, softcap):
    """(B, S, h, D) math attention, causal, keys i - window_size_left <= j <= i (-1: all), scores soft-capped
    (0.0: not), GQA by repetition; also the log-sum-exp (B, h, S)."""
    groups = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh, vh = (t.transpose(1, 2).repeat_interleave(groups, 1) for t in (k, v))
    scores = qh @ kh.transpose(-1, -2) * softmax_scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    seq = q.shape[1]
    visible = torch.ones(seq, seq, dtype=torch.bool).tril()
    if window_size_left >= 0:
        visible &= torch.ones(seq, seq, dtype=torch.bool).triu(-window_size_left)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None])
    gen = torch.Generator().manual_seed(int(rng_state[0]))
    keep = (torch.rand(probs.shape, generator=gen, dtype=probs.dtype) >= dropout_p).to(probs.dtype)
    return (probs * keep / (1 - dropout_p) @ vh).transpose(1, 2), lse


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax):
    CALLS.append(("forward", dict(locals())))
    rng_state = torch.tensor([1000 + len(CALLS), 0])
    with torch.no_grad():
        out, lse = _attention(q, k, v, dropout_p, softmax_scale, rng_state, window_size_left, softcap)
    return out.contiguous(), lse, None, rng_state


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    CALLS.append(("backward", dict(locals())))
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        again, _ = _attention(*leaves, dropout_p, softmax_scale, rng_state, window_size_left, softcap)
        grads = torch.autograd.grad(again, leaves, dout)
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.copy_(grad)
    return torch.empty(0)
'''


def _install(tmp_path, monkeypatch, version, interface):
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (package / "flash_attn_interface.py").write_text(textwrap.dedent(interface))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture(autouse=True)
def _fresh_import():
    flash_attn_package.flash_attn_interface.cache_clear()
    yield
    flash_attn_package.flash_attn_interface.cache_clear()
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


def _load_twice():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = flash_attn_package.flash_attn_interface()
        second = flash_attn_package.flash_attn_interface()
    assert first is second
    return first, [str(w.message) for w in caught]


def test_an_install_whose_extension_fails_to_load_falls_back_with_one_warning(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "2.8.3", 'raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c10")')
    module, messages = _load_twice()
    assert module is None
    assert len(messages) == 1 and "does not load (ImportError: flash_attn_2_cuda.so: undefined symbol" in messages[0]
    assert attention_core.select_backend("cuda", torch.bfloat16, 128, capability=(9, 0)) == "cuda-flash"


@pytest.mark.parametrize("version", ["2.6.3", "2.9.0", "3.0.0b1", "unknown"])
def test_an_unsupported_version_falls_back_with_one_warning(tmp_path, monkeypatch, version):
    _install(tmp_path, monkeypatch, version, FAKE_INTERFACE)
    module, messages = _load_twice()
    assert module is None
    assert len(messages) == 1 and f"flash-attn {version} is installed" in messages[0]
    assert ">=2.7.0,<2.9.0" in messages[0]


def test_no_install_means_pytorch_kernels_without_a_warning(monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p])  # nothing named flash_attn on the path here
    module, messages = _load_twice()
    assert module is None and messages == []


@pytest.mark.parametrize("version", ["2.7.0", "2.8.3.post1", "2.8.3+cu12torch2.7"])
def test_a_supported_install_is_imported_once(tmp_path, monkeypatch, version):
    _install(tmp_path, monkeypatch, version, FAKE_INTERFACE)
    module, messages = _load_twice()
    assert module is not None and module.__name__ == "flash_attn.flash_attn_interface" and messages == []


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("window,softcap", [(None, None), (4, 2.0)])
def test_the_core_calls_flash_attn_with_its_interface_and_gets_exact_gradients(
    tmp_path, monkeypatch, dropout_p, window, softcap
):
    """Forward and backward through the flash-attn backend: (B, S, h, D) tensors with a unit last stride, K/V with
    h_kv heads (no expansion), named arguments of the 2.7/2.8 signatures (a window of w keys as (w - 1, 0), the
    soft-cap as it is), the forward's rng_state handed to the backward; results equal autograd through the same
    math with the same mask."""
    _install(tmp_path, monkeypatch, "2.8.3", FAKE_INTERFACE)
    fake = flash_attn_package.flash_attn_interface()
    monkeypatch.setattr(attention_core, "backend_for", lambda q, traits, causal=True, value_head_dim=None: "flash-attn")
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 11, 4, 8, dtype=torch.float64, generator=gen).transpose(1, 2)
    k, v = (torch.randn(2, 11, 2, 8, dtype=torch.float64, generator=gen).transpose(1, 2) for _ in range(2))
    upstream = torch.randn(2, 11, 4, 8, dtype=torch.float64, generator=gen).transpose(1, 2)

    traits = AttentionTraits(0.3, dropout_p, window, softcap)
    out, stats = attention_forward(q, k, v, traits)
    dq, dk, dv, _ = attention_backward(upstream, q, k, v, out, stats, traits)

    (_, fwd), (_, bwd) = fake.CALLS
    assert [fwd[n].shape for n in "qkv"] == [(2, 11, 4, 8), (2, 11, 2, 8), (2, 11, 2, 8)]
    assert all(fwd[n].stride(-1) == 1 for n in "qkv") and fwd["q"].is_contiguous()
    assert {n: fwd[n] for n in ("dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right")} == {
        "dropout_p": dropout_p,
        "softmax_scale": 0.3,
        "causal": True,
        "window_size_left": -1 if window is None else window - 1,
        "window_size_right": -1 if window is None else 0,
    }
    assert (fwd["softcap"], fwd["alibi_slopes"], fwd["return_softmax"]) == (softcap or 0.0, None, False)
    assert bwd["dk"].shape == bwd["k"].shape == (2, 11, 2, 8) and bwd["dq"].shape == (2, 11, 4, 8)
    assert bwd["rng_state"] is stats.extra[0] and bwd["dropout_p"] == dropout_p and bwd["causal"] is True
    windows = (bwd["window_size_left"], bwd["window_size_right"])
    assert windows == (fwd["window_size_left"], fwd["window_size_right"]) and bwd["softcap"] == fwd["softcap"]
    assert bwd["deterministic"] is False
    assert out.transpose(1, 2).is_contiguous() and stats.lse.shape == (2, 4, 11)

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    scores = leaves[0] @ expand_kv(leaves[1], 2).transpose(-1, -2) * 0.3
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(11)[:, None], torch.arange(11)
    scores = scores.masked_fill((j > i) | (j <= i - (window or 11)), float("-inf"))
    rng = torch.Generator().manual_seed(int(stats.extra[0][0]))
    keep = (torch.rand(scores.shape, generator=rng, dtype=scores.dtype) >= dropout_p).to(scores.dtype)
    want = (scores.softmax(-1) * keep / (1 - dropout_p)) @ expand_kv(leaves[2], 2)
    want.backward(upstream)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    for got, leaf in zip((dq, dk, dv), leaves):
        assert got.shape == leaf.shape
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)
