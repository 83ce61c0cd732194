"""Router logits of mixture-of-experts models: the routers transformers records, their logits collected once per
router call with gradient in every mode (chunked MLP, memo executor, whole models), and the router aux loss."""

import copy
from contextlib import contextmanager

import pytest
import torch
import transformers
from torch import nn
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func
from transformers.utils.output_capturing import (
    OutputRecorder,
    _active_collector,
    install_all_output_capturing_hooks,
    install_output_capuring_hook,
)

import hf_memo
from hf_memo.config import MemoConfig
from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.patches.forwards import mlp_forward
from hf_memo.patches.router_logits import RouterLogitsSplit, router_aux_loss, router_modules, router_recorders
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.executor import MemoLayerFunction
from hf_memo.runtime.memo import MemoRuntime
from tests.conftest import assert_same_grads, make_batch
from tests.model_catalog import build_catalog_model
from tests.test_minseq_mlp import MOE_MODELS
from tests.test_runtime_executor import HIDDEN, ToySplit, _params, _reference

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off")

MODES = {
    "none": {"recompute": "none"},
    "full": {"recompute": "full"},
    "selective": {"recompute": "selective"},
    "memo-0.5": {"recompute": "memo", "offload_fraction": 0.5},
    "memo-1.0": {"recompute": "memo", "offload_fraction": 1.0},
}


@contextmanager
def collecting():
    """transformers' collection of router logits, as a backbone forward with ``output_router_logits`` sets it."""
    collected = {"router_logits": []}
    token = _active_collector.set(collected)
    try:
        yield collected["router_logits"]
    finally:
        _active_collector.reset(token)


def _close(got, want, rtol=1e-10, atol=1e-13):
    assert (got is None) == (want is None)
    if want is not None:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


class _Router(nn.Linear):
    pass


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = _Router(4, 2)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp, self.probe = _Block(), _Block()


class _Backbone(nn.Module):
    _can_record_outputs = {"router_logits": OutputRecorder(_Router, index=0, layer_name="mlp.gate")}

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])


def test_routers_are_the_modules_transformers_records():
    model = build_catalog_model("qwen3_moe-mixed")  # MoE layers 0 and 2 around a dense layer 1
    layers = model.model.layers
    assert router_modules(model) == [layers[0].mlp.gate, layers[2].mlp.gate]
    assert router_modules(model.model) == router_modules(model)
    dense = build_catalog_model("llama")
    assert router_recorders(dense) == [] and router_modules(dense) == []


def test_a_layer_name_filter_and_a_bare_class_are_read_as_transformers_reads_them():
    backbone = _Backbone()
    assert router_modules(backbone) == [layer.mlp.gate for layer in backbone.layers]
    bare = type("Bare", (_Backbone,), {"_can_record_outputs": {"router_logits": _Router}})()
    assert [recorder.index for recorder in router_recorders(bare)] == [1]
    assert len(router_modules(bare)) == 4


@pytest.mark.parametrize("name", MOE_MODELS)
def test_the_chunked_mlp_records_each_router_once_with_its_gradient(name):
    """The block in 4 chunks across 2 sequences: transformers' collection gets one (B * S, E) entry, equal to the
    unchunked block's, and a load-balancing loss over it differentiates like the unchunked block's."""
    model = build_catalog_model(name)
    install_all_output_capturing_hooks(model.model)  # what transformers does at the first collecting forward
    block = model.model.layers[0].mlp
    params = list(block.parameters())
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    upstream = torch.randn(2, 11, 32, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0
    results = []
    for chunks in (None, 4):
        xg = x.clone().requires_grad_(True)
        with collecting() as logits:
            if chunks is None:
                out = block(xg)
            else:
                out = mlp_forward(MemoConfig(mlp_chunks=chunks), 16, block, block.forward, xg)
        assert len(logits) == 1 and logits[0].shape == (22, 4) and logits[0].requires_grad
        hidden = out[0] if isinstance(out, tuple) else out
        loss = (hidden * upstream).sum() + router_aux_loss(model, tuple(logits), mask)
        results.append((logits[0].detach(), torch.autograd.grad(loss, [xg, *params], allow_unused=True)))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert params[0].grad is None  # (gradients were returned, not accumulated)
    for g, w in zip(got_grads, want_grads):
        _close(g, w)


def test_without_gradient_or_collection_the_chunked_mlp_returns_the_block_output():
    model = build_catalog_model("qwen3_moe")
    install_all_output_capturing_hooks(model.model)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    config = MemoConfig(mlp_chunks=3)
    with torch.no_grad():
        with collecting() as want:
            block(x)
        with collecting() as got:
            out = mlp_forward(config, 16, block, block.forward, x)
        assert len(got) == 1
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(out, block(x), rtol=1e-12, atol=1e-14)
    out = mlp_forward(config, 16, block, block.forward, x.requires_grad_(True))  # nothing collects: no logits
    assert isinstance(out, torch.Tensor) and out.requires_grad


class MoeToySplit(ToySplit):
    """The executor tests' toy layer with a real Qwen3-MoE block as its MLP: ``h + moe(h)``, ``h = x + o W_o``."""

    def __init__(self, params, positions):
        super().__init__(params, positions)
        config = transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
        )
        config._experts_implementation = "eager"
        self.block = Qwen3MoeSparseMoeBlock(config).double()
        gen = torch.Generator().manual_seed(5)
        for p in self.block.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
        install_output_capuring_hook(self.block.gate, "router_logits", 0)  # transformers' recorder hook

    def finish(self, x, o, start):
        h = x + o @ self.wo
        return h + self.block(h)

    def params(self):
        return [*super().params(), *self.block.parameters()]


@pytest.mark.parametrize("alpha_chunks", [0, 2, 4])
@pytest.mark.parametrize("keep_attention", [True, False], ids=["X+attn", "X-only"])
def test_the_memo_executor_returns_router_logits_with_their_gradient(alpha_chunks, keep_attention):
    """Offloaded (graph recorded) and recomputed chunks: the layer's router logits come out once, (B * S, E) in
    transformers' batch-major order, and a load-balancing loss over them differentiates like the plain layer."""
    split = MoeToySplit(_params(), torch.linspace(0.5, 1.5, 13, dtype=torch.float64))
    params = split.params()
    x = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    runtime = MemoRuntime(MemoConfig(recompute="memo"), 1)
    runtime.assume_policy(MemoryPolicy((LayerPolicy(keep_attention, False),)))
    runtime.alpha_chunks(split, x[:, :1], [(0, 1)], LocalAttention, 0)

    def memo(t):
        wrapped = RouterLogitsSplit(split)
        out = MemoLayerFunction.apply(
            runtime, wrapped, LocalAttention, 0, chunk_bounds(13, 4), alpha_chunks, t, *params
        )
        return RouterLogitsSplit.recorded(out)

    results = []
    for layer in (lambda t: _reference(split, t), memo):
        xg = x.clone().requires_grad_(True)
        with collecting() as logits:
            y = layer(xg)
        assert len(logits) == 1 and logits[0].shape == (26, 4)
        loss = (y * upstream).sum() + load_balancing_loss_func(tuple(logits), 4, 2)
        results.append((y.detach(), logits[0].detach(), torch.autograd.grad(loss, [xg, *params], allow_unused=True)))
    (want_y, want_logits, want_grads), (got_y, got_logits, got_grads) = results
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-12, atol=1e-13)
    for g, w in zip(got_grads, want_grads):
        _close(g, w, atol=1e-12)


def _padded_batch(seed=1):
    ids, labels = make_batch(2, 29, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    labels[mask == 0] = -100
    return ids, labels, mask


def _assert_same_router_logits(got, want, mask):
    """One entry per MoE layer, ``(B * S, E)``, equal on the tokens the mask keeps (padding rows attend per sample
    under hf_memo, so their hidden states, which no loss reads, are not transformers')."""
    assert got is not None and len(got) == len(want)
    keep = mask.flatten().bool()
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g[keep], w[keep], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_a_training_forward_without_labels_returns_router_logits_with_their_gradient(mode):
    """transformers' own forward (no labels) over hf_memo's layers: its router logits and aux loss are the unpatched
    model's, and the aux loss alone backpropagates through the routers to every parameter below like it."""
    reference = build_catalog_model("qwen3_moe-mixed")  # MoE, dense, MoE
    model = hf_memo.apply(copy.deepcopy(reference), mlp_chunks=3, lm_head_chunks=3, **MODES[mode])
    ids, _, mask = _padded_batch()
    want = reference(input_ids=ids, attention_mask=mask, use_cache=False)
    got = model(input_ids=ids, attention_mask=mask, use_cache=False)
    _assert_same_router_logits(got.router_logits, want.router_logits, mask)
    want.aux_loss.backward()
    got.aux_loss.backward()
    assert_same_grads(model, reference)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["none", "memo-0.5"])
def test_output_router_logits_as_an_argument_adds_the_aux_loss_to_the_loss(mode):
    reference = build_catalog_model("qwen3_moe")
    reference.config.output_router_logits = False
    model = hf_memo.apply(copy.deepcopy(reference), mlp_chunks=3, lm_head_chunks=3, **MODES[mode])
    ids, labels, mask = _padded_batch(seed=2)
    outputs = []
    for m in (reference, model):
        plain = m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out = m(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True, use_cache=False)
        out.loss.backward()
        outputs.append((plain, out))
    (want_plain, want), (got_plain, got) = outputs
    assert got_plain.aux_loss is None and got_plain.router_logits is None
    torch.testing.assert_close(got_plain.loss, want_plain.loss, rtol=1e-6, atol=0)
    assert isinstance(got, MoeCausalLMOutputWithPast) and got.logits is None
    assert_same_grads(model, reference)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    assert not torch.allclose(got.loss, got_plain.loss)  # the aux loss is in it
    _assert_same_router_logits(got.router_logits, want.router_logits, mask)


def test_an_evaluation_forward_in_chunks_records_each_router_once():
    reference = build_catalog_model("qwen3_moe").eval()
    model = hf_memo.apply(copy.deepcopy(reference), mlp_chunks=3, recompute="none")
    ids, _, _ = _padded_batch()
    with torch.no_grad():
        want, got = reference(input_ids=ids), model(input_ids=ids)
    _assert_same_router_logits(got.router_logits, want.router_logits, torch.ones_like(ids))
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_chunks_record_router_logits_without_a_second_capture_in_the_chain(recompute, monkeypatch):
    """transformers' own tests refuse a collector set while its capture is active (a capture in a chain): the
    chunks swap the list under the router-logits key of transformers' collector instead."""
    set_collector = _active_collector.set

    def set_once(value):
        if value is not None and _active_collector.get() is not None:
            raise AssertionError("a collector set inside transformers' capture")
        return set_collector(value)

    model = hf_memo.apply(build_catalog_model("qwen3_moe"), recompute=recompute, mlp_chunks=3, lm_head_chunks=3)
    monkeypatch.setattr(_active_collector, "set", set_once)
    ids, labels = make_batch(2, 13)
    out = model(input_ids=ids, labels=labels, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (2 * 13, 4)
