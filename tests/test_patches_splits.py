"""The family splits (Llama layout, GPT-2) under the memo executor: attention dropout against the unpatched model
with the same dropout mask, and a single stashed copy of the attention output."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_utils import AttentionInterface

import hf_memo
from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.patches.layer_split import split_layer
from hf_memo.runtime.attention_core import LocalAttention, expand_kv
from hf_memo.runtime.dropout_attention import draw_seed, keep_mask
from hf_memo.runtime.executor import MemoLayerFunction
from tests.conftest import assert_same_grads, build_model, make_batch
from tests.stash_recording import RecordingSource, attention_output_copies

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off")

DROPOUT = {"gpt2": {"attn_pdrop": 0.1}, "llama": {"attention_dropout": 0.1}, "qwen3": {"attention_dropout": 0.2}}


def _masked_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Eager causal attention (plain autograd) whose dropout mask is the memo core's CPU mask for a seed drawn
    from the CPU generator at the same point of the step as the core draws it: the same mask, by construction."""
    assert attention_mask is None  # no padding: transformers leaves causality to the attention function
    batch, heads, seq, _ = query.shape
    groups = heads // key.shape[1]
    scores = query @ expand_kv(key, groups).transpose(-1, -2) * scaling
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    probs = scores.softmax(-1)
    if dropout > 0:
        probs = probs * keep_mask(draw_seed(), dropout, batch, heads, seq, (0, seq), seq, query.device) / (1 - dropout)
    return (probs @ expand_kv(value, groups)).transpose(1, 2).contiguous(), None


def _loss_and_backward(model, ids, labels):
    torch.manual_seed(11)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("family", sorted(DROPOUT))
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_memo_with_attention_dropout_matches_unpatched_with_the_same_mask(monkeypatch, family, alpha):
    """The unpatched model runs transformers' own layers with the "sdpa" attention function replaced by explicit
    math that applies the mask the memo core's mask source gives for the seed drawn at that call; both models
    draw one seed per layer from the CPU generator in the same order. Loss and every gradient must agree."""
    _compare_with_masked_reference(monkeypatch, family, offload_fraction=alpha)


def test_attention_dropout_with_the_memory_planner(monkeypatch):
    """The planner profiles a fake step (no mask values exist there): it must not disturb the real one."""
    _compare_with_masked_reference(monkeypatch, "gpt2", offload_fraction=0.5, planner="greedy")


def _compare_with_masked_reference(monkeypatch, family, **memo):
    layers = {"n_layer": 3} if family == "gpt2" else {"num_hidden_layers": 3}
    model = build_model(family, **layers, **DROPOUT[family])
    reference = copy.deepcopy(model)
    hf_memo.apply(model, recompute="memo", mlp_chunks=4, lm_head_chunks=3, **memo)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", _masked_attention)
    ids, labels = make_batch(2, 19)
    got, want = _loss_and_backward(model, ids, labels), _loss_and_backward(reference, ids, labels)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
    reference.zero_grad()
    reference.eval()  # dropout off: the loss differs, so the comparison above did see dropout
    with torch.no_grad():
        assert abs(reference(input_ids=ids, labels=labels).loss - want) > 1e-4


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_split_dropout_follows_the_config_in_training_only(family):
    model = build_model(family, **DROPOUT[family])
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    if family == "gpt2":
        layer, arguments = model.transformer.h[0], {}
    else:
        layer = model.model.layers[0]
        arguments = {"position_embeddings": model.model.rotary_emb(x, torch.arange(5)[None])}
    assert split_layer(layer, x, **arguments).traits.dropout_p == 0.1
    model.eval()
    assert split_layer(layer, x, **arguments).traits.dropout_p == 0.0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_offloading_every_token_of_a_real_layer_stashes_one_copy_of_the_attention_output(family):
    """Two sequences in three chunks, all offloaded: the rows o_proj / c_proj read are views of the attention
    output, and no flattened copy of them is saved for the weight gradient. The output equals the layer's."""
    model = build_model(family)
    x = torch.randn(2, 10, 32, dtype=torch.float64, requires_grad=True)
    if family == "gpt2":
        layer, embeddings = model.transformer.h[0], None
    else:
        layer = model.model.layers[0]
        embeddings = model.model.rotary_emb(x, torch.arange(10)[None])
    split = split_layer(layer, x, **({} if embeddings is None else {"position_embeddings": embeddings}))
    source = RecordingSource()
    params = list(layer.parameters())
    y = MemoLayerFunction.apply(source, split, LocalAttention, 2, chunk_bounds(10, 3), 3, x, *params)
    with torch.no_grad():
        q, k, v = split.project(x, 0, 10)
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, expand_kv(k, groups), expand_kv(v, groups), is_causal=True)
        want = layer(x, position_embeddings=embeddings) if embeddings is not None else layer(x)
    assert attention_output_copies(source.stash, out) == 1
    torch.testing.assert_close(y, want[0] if isinstance(want, tuple) else want, rtol=1e-12, atol=1e-12)
