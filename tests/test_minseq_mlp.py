import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.minseq.mlp import minseq_mlp
from tests.conftest import ShapeRecorder
from tests.model_catalog import build_catalog_model

# Catalog models whose layer 0 is a mixture-of-experts block (4 experts, top-2, hidden 32, fp64, eager experts).
MOE_MODELS = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss"]


class GatedMLP(nn.Module):
    """Llama-style MLP: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, width, bias=False)
        self.up = nn.Linear(hidden, width, bias=True)
        self.down = nn.Linear(width, hidden, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.down(nn.functional.silu(self.gate(x)) * self.up(x)))


def _grads(out, x, module, upstream):
    out.backward(upstream)
    return [x.grad] + [p.grad for p in module.parameters()]


def _run(module, x, upstream, chunks=None):
    module.zero_grad()
    x = x.detach().requires_grad_(True)
    out = module(x) if chunks is None else minseq_mlp(module, x, list(module.parameters()), chunks)
    return out.detach(), _grads(out, x, module, upstream)


@settings(max_examples=40, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=2),
    hidden=st.integers(1, 12),
    width=st.integers(1, 40),
    chunks=st.integers(1, 13),
    seed=st.integers(0, 2**16),
)
def test_output_and_every_gradient_equal_the_unchunked_mlp(lead, hidden, width, chunks, seed):
    torch.manual_seed(seed)
    module = GatedMLP(hidden, width).double()
    x = torch.randn(*lead, hidden, dtype=torch.float64)
    upstream = torch.randn(*lead, hidden, dtype=torch.float64)
    ref_out, ref_grads = _run(module, x, upstream)
    out, grads = _run(module, x, upstream, chunks)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_full_length_intermediate_never_exists_in_forward_or_backward():
    rows, hidden, width, chunks = 64, 4, 32, 4
    module = GatedMLP(hidden, width).double()
    x = torch.randn(rows, hidden, dtype=torch.float64, requires_grad=True)
    with ShapeRecorder() as recorder:
        minseq_mlp(module, x, list(module.parameters()), chunks).sum().backward()
    widest = [s for s in recorder.shapes if s and s[-1] == width and len(s) == 2]
    assert widest, "the recorder saw no intermediate"
    assert max(s[0] for s in widest) == math.ceil(rows / chunks)
    # Weight gradients (width x hidden) are fine; nothing is as large as the (rows, width) intermediate.
    assert recorder.largest() < rows * width


def test_dropout_masks_are_replayed_when_chunks_are_recomputed():
    torch.manual_seed(0)
    module = GatedMLP(6, 20, dropout=0.5).double().train()
    x = torch.randn(30, 6, dtype=torch.float64)
    upstream = torch.randn(30, 6, dtype=torch.float64)
    bounds = [(0, 10), (10, 20), (20, 30)]
    # Reference: the same chunks, same RNG stream, differentiated directly through autograd.
    torch.manual_seed(123)
    module.zero_grad()
    x_ref = x.clone().requires_grad_(True)
    ref_out = torch.cat([module(x_ref[a:b]) for a, b in bounds])
    ref_grads = _grads(ref_out, x_ref, module, upstream)
    torch.manual_seed(123)
    out, grads = _run(module, x, upstream, chunks=3)
    torch.testing.assert_close(out, ref_out.detach(), rtol=0, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_frozen_parameters_get_no_gradient_and_trainable_ones_do():
    module = GatedMLP(5, 16).double()
    module.gate.weight.requires_grad_(False)
    x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
    trainable = [p for p in module.parameters() if p.requires_grad]
    minseq_mlp(module, x, trainable, 4).sum().backward()
    assert module.gate.weight.grad is None
    assert module.up.weight.grad is not None and module.down.weight.grad is not None


def test_gradient_hooks_fire_once_per_parameter():
    module = GatedMLP(5, 16).double()
    fired = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: fired.append(n))
    x = torch.randn(17, 5, dtype=torch.float64, requires_grad=True)
    minseq_mlp(module, x, list(module.parameters()), 5).sum().backward()
    assert sorted(fired) == sorted(n for n, _ in module.named_parameters())


def test_no_grad_and_single_chunk_paths():
    module = GatedMLP(5, 16).double()
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(minseq_mlp(module, x, list(module.parameters()), 3), module(x), rtol=1e-12, atol=0)
    assert torch.equal(minseq_mlp(module, x, list(module.parameters()), 1), module(x))


@pytest.mark.parametrize("chunks", [2, 5])
def test_bf16_autocast_is_replayed_in_backward(chunks):
    torch.manual_seed(0)
    module = GatedMLP(16, 48)
    seen_dtypes = []
    module.down.register_forward_hook(lambda _m, _i, out: seen_dtypes.append(out.dtype))
    x = torch.randn(40, 16)
    upstream = torch.randn(40, 16)
    results = []
    for use_chunks in (None, chunks):
        module.zero_grad()
        xg = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(xg) if use_chunks is None else minseq_mlp(module, xg, list(module.parameters()), use_chunks)
        seen_dtypes.clear()
        results.append((out.detach(), _grads(out, xg, module, upstream)))  # backward outside autocast
    # The chunked recomputation in backward ran under bf16 autocast, like the forward did.
    assert seen_dtypes == [torch.bfloat16] * chunks
    (ref_out, ref_grads), (got_out, got_grads) = results
    torch.testing.assert_close(got_out, ref_out, rtol=0, atol=0)
    for got, want in zip(got_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_a_dense_chunk_is_bitwise_the_mlp_on_its_rows():
    """Chunks are (1, n, H) views of the flattened rows: a dense MLP computes on them what it computes on (n, H)."""
    module = GatedMLP(8, 24)
    x = torch.randn(3, 7, 8, requires_grad=True)
    rows = x.reshape(-1, 8)
    want = torch.cat([module(rows[a:b]) for a, b in chunk_bounds(21, 4)]).reshape(3, 7, 8)
    assert torch.equal(minseq_mlp(module, x, list(module.parameters()), 4), want)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_a_mixture_of_experts_block_in_chunks_is_the_block(name):
    """The block as a whole (router, experts, qwen2_moe's gated shared expert; gpt-oss's tuple with its router
    scores) on 22 tokens in 4 chunks that cut across the two sequences, against the unchunked block."""
    block = build_catalog_model(name).model.layers[0].mlp
    params = list(block.parameters())
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    results = []
    for chunks in (None, 4):
        xg = x.clone().requires_grad_(True)
        out = block(xg) if chunks is None else minseq_mlp(block, xg, params, chunks)
        outs = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(1)
        upstream = [torch.randn_like(o) for o in outs]
        results.append((outs, torch.autograd.grad(outs, [xg, *params], upstream, allow_unused=True)))
    (want, want_grads), (got, got_grads) = results
    assert [o.shape for o in got] == [o.shape for o in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    for g, w in zip(got_grads, want_grads):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
