"""The packed (varlen flash) path of the per-sample attention core on CUDA (GPU only): one kernel call per batch,
output and gradients equal to per-sample calls of the same kernel, dropout replayed from its RNG state."""

import pytest
import torch

from hf_memo.runtime import varlen_attention
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.batch_layout import BatchLayout
from hf_memo.runtime.varlen_attention import PackedKernels, VarlenAttention, packed_kernels_for

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0), reason="needs a CUDA flash GPU"
)
ROWS = (tuple((16 * i, 16 * i + 16) for i in range(64)), ((5, 300), (300, 700), (700, 1000)))  # 64 short samples


@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("window,sinks", [(None, False), (64, True)])
def test_packed_flash_equals_per_sample_calls(kv_heads, window, sinks, monkeypatch):
    torch.manual_seed(0)
    q = torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(2, 1024, kv_heads, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in "kv")
    grad_out = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)
    traits = AttentionTraits(0.125, window=window, sinks=torch.randn(8, device="cuda") if sinks else None)
    layout = BatchLayout(1024, ROWS)
    assert packed_kernels_for(q, layout, traits) is PackedKernels
    packed = VarlenAttention(layout)
    out, stats = packed.forward(q, k, v, traits)
    assert stats.extra[0] == "packed"
    grads = packed.backward(grad_out, q, k, v, out, stats, traits)
    monkeypatch.setattr(varlen_attention, "packed_kernels_for", lambda q, layout, traits: None)  # per-block calls
    per_sample = VarlenAttention(layout)
    want_out, want_stats = per_sample.forward(q, k, v, traits)
    want_grads = per_sample.backward(grad_out, q, k, v, want_out, want_stats, traits)
    pairs = [(a, b) for a, b in zip((out, *grads), (want_out, *want_grads)) if b is not None]
    errors = [float((a.float() - b.float()).abs().max()) for a, b in pairs]
    print(f"packed vs per-sample flash (kv heads {kv_heads}, {traits}): max abs differences {errors}")
    torch.testing.assert_close(out, want_out, rtol=2e-2, atol=2e-2)
    for got, want in pairs[1:]:
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
    assert (out[1, :, :5] == 0).all() and (grads[0][1, :, 1000:] == 0).all()


def test_packed_flash_dropout_is_replayed_by_its_backward_and_by_a_restored_generator():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 512, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in "qkv")
    layout = BatchLayout(512, (((0, 200), (200, 512)),))
    core = VarlenAttention(layout)
    state = torch.cuda.get_rng_state()
    first, _ = core.forward(q, k, v, AttentionTraits(0.125, 0.3))
    torch.cuda.set_rng_state(state)
    again, _ = core.forward(q, k, v, AttentionTraits(0.125, 0.3))
    assert torch.equal(first, again)  # what an input-only layer's recomputation relies on
