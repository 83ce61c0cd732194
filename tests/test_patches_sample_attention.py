"""Per-sample attention with sdpa beyond a sliding window: the windowed stand-in for sdpa against transformers' sdpa
with its sliding mask, and Mistral with a window shorter than its samples trained per sample against the
unpatched model run on each sample alone."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sliding_window_causal_mask_function

import hf_memo
from hf_memo.parallel import attention
from hf_memo.parallel.attention import sdpa_with_window
from tests.conftest import build_model
from tests.test_patches_packing import assert_packed_row_equals_samples_alone


def _module(groups):
    return SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=True)


def _inputs(kv_heads, seq=13):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, generator=gen) for _ in "kv")
    return q, k, v, torch.randn(2, seq, 4, 8, dtype=torch.float64, generator=gen)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("window", [1, 5])
def test_sdpa_with_window_computes_sdpa_with_transformers_sliding_mask(kv_heads, window):
    """Forward and backward; sinks (``s_aux``) are ignored, as sdpa ignores them."""
    q, k, v, upstream = _inputs(kv_heads)
    module = _module(4 // kv_heads)
    mask = eager_mask(2, 13, 13, mask_function=sliding_window_causal_mask_function(window), dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want, _ = sdpa_attention_forward(module, *leaves, mask, scaling=0.3)
    want.backward(upstream)
    got_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kwargs = {"scaling": 0.3, "dropout": 0.0, "sliding_window": window, "s_aux": torch.ones(4, dtype=torch.float64)}
    got, _ = sdpa_with_window(module, *got_leaves, None, **kwargs)
    got.backward(upstream)
    assert got.shape == want.shape == (2, 13, 4, 8)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    for mine, leaf in zip(got_leaves, leaves):
        torch.testing.assert_close(mine.grad, leaf.grad, rtol=1e-10, atol=1e-12)


def test_sdpa_with_window_is_sdpa_wherever_sdpa_computes_the_window(monkeypatch):
    """A window covering every query, or a mask transformers built: sdpa itself runs; a soft-cap, which sdpa
    refuses, is refused as sdpa refuses it."""
    monkeypatch.setattr(attention, "core_attention", lambda *args: pytest.fail("the core ran where sdpa computes"))
    q, k, v, _ = _inputs(2)
    module = _module(2)
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    for window, mask in ((13, None), (40, None), (None, None)):
        got, _ = sdpa_with_window(module, q, k, v, mask, scaling=0.3, sliding_window=window)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    mask = eager_mask(2, 13, 13, mask_function=sliding_window_causal_mask_function(3), dtype=torch.float64)
    sdpa_with_window(module, q, k, v, mask, scaling=0.3, sliding_window=3)
    with pytest.raises(ValueError, match="does not support `softcap`"):
        sdpa_with_window(module, q, k, v, None, scaling=0.3, sliding_window=3, softcap=5.0)


@pytest.mark.parametrize("recompute,alpha", [("none", None), ("full", None), ("selective", None), ("memo", 0.5)])
def test_a_window_shorter_than_the_samples_trains_per_sample_as_each_sample_alone(recompute, alpha):
    """Mistral with sdpa and a window of 4 over samples of 3 to 9 tokens: per-sample sdpa calls get the window
    (the memo core too), exactly as transformers' sliding mask gives each sample run alone."""
    reference = build_model("mistral", num_hidden_layers=2, sliding_window=4)
    extra = {} if alpha is None else {"offload_fraction": alpha}
    model = hf_memo.apply(copy.deepcopy(reference), recompute=recompute, mlp_chunks=3, lm_head_chunks=2, **extra)
    assert_packed_row_equals_samples_alone(model, reference)
