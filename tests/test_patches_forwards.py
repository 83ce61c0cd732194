"""Patched models against the unpatched Hugging Face model: same loss and every gradient, all families."""

import inspect

import pytest
import torch

import hf_memo
from tests.conftest import assert_same_grads, build_model, make_batch, model_pair

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off")


def _enable_checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _step(model, ids, labels, **kwargs):
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf-checkpointing"])
@pytest.mark.parametrize("batch,seq", [(1, 17), (2, 16), (3, 31)])
@pytest.mark.parametrize("mlp_chunks,lm_head_chunks", [(1, 1), (3, 5), (7, 4)])
def test_loss_and_every_gradient_match_unpatched(family, batch, seq, mlp_chunks, lm_head_chunks, checkpointing):
    model, reference = model_pair(family)
    if checkpointing:
        _enable_checkpointing(model)
        _enable_checkpointing(reference)
    hf_memo.apply(model, mlp_chunks=mlp_chunks, lm_head_chunks=lm_head_chunks)
    ids, labels = make_batch(batch, seq)
    got = _step(model, ids, labels)
    want = _step(reference, ids, labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    assert_same_grads(model, reference)


def test_num_items_in_batch_and_gradient_accumulation(family):
    model, reference = model_pair(family)
    hf_memo.apply(model, mlp_chunks=3, lm_head_chunks=3)
    micro_batches = [make_batch(2, 19, seed=s) for s in (1, 2, 3)]
    # As the Trainer does: every micro-batch is divided by the valid-token count of the whole step.
    num_items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro_batches)
    for ids, labels in micro_batches:
        got = _step(model, ids, labels, num_items_in_batch=torch.tensor(num_items))
        want = _step(reference, ids, labels, num_items_in_batch=torch.tensor(num_items))
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    assert_same_grads(model, reference)


def test_shift_labels_are_honoured(family):
    model, reference = model_pair(family)
    hf_memo.apply(model, lm_head_chunks=4)
    ids, labels = make_batch(2, 15)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shift[0, 3] = -100  # differ from what shifting `labels` would give, so using them is observable
    got = _step(model, ids, labels, shift_labels=shift)
    want = _step(reference, ids, labels, shift_labels=shift)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    assert_same_grads(model, reference)


def test_fully_masked_row_and_tied_embeddings():
    model, reference = model_pair("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf_memo.apply(model, lm_head_chunks=5, mlp_chunks=2)
    ids, labels = make_batch(3, 12)
    labels[1] = -100
    got = _step(model, ids, labels)
    want = _step(reference, ids, labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    assert_same_grads(model, reference)


def test_frozen_lm_head_gets_no_gradient(family):
    model, reference = model_pair(family)
    for m in (model, reference):
        m.get_output_embeddings().weight.requires_grad_(False)
    hf_memo.apply(model, lm_head_chunks=3)
    ids, labels = make_batch(2, 11)
    _step(model, ids, labels)
    _step(reference, ids, labels)
    assert model.get_output_embeddings().weight.grad is None
    assert_same_grads(model, reference)


def test_evaluation_and_generate_are_unchanged(family):
    model, reference = model_pair(family)
    hf_memo.apply(model, mlp_chunks=1, lm_head_chunks=3)
    model.eval()
    reference.eval()
    ids, labels = make_batch(2, 10)
    with torch.no_grad():
        got, want = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    prompt = ids[:1, :4]
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, reference.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0))


def test_chunked_mlp_in_evaluation_matches(family):
    model, reference = model_pair(family)
    hf_memo.apply(model, mlp_chunks=4)
    model.eval()
    reference.eval()
    ids, _ = make_batch(2, 21)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-12, atol=1e-12)


@pytest.mark.usefixtures("self_check_off")
def test_hf_checkpointing_still_checkpoints_every_layer(family):
    model = build_model(family)
    _enable_checkpointing(model)
    hf_memo.apply(model, mlp_chunks=2)
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) and hasattr(m, "mlp")]
    checkpoint_calls = []
    for layer in layers:
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda fn, *a, _inner=inner, **k: (
            checkpoint_calls.append(1),
            _inner(fn, *a, **k),
        )[1]
    attention_runs = []
    for layer in layers:
        attn = layer.self_attn if hasattr(layer, "self_attn") else layer.attn
        attn.register_forward_hook(lambda *_: attention_runs.append(1))
    ids, labels = make_batch(2, 16)
    _step(model, ids, labels)
    assert len(checkpoint_calls) == len(layers) == model.config.num_hidden_layers
    assert len(attention_runs) == 2 * len(layers)  # forward + recomputation in backward


def test_patched_forward_keeps_the_signature_the_trainer_reads(family):
    model = build_model(family)
    before = inspect.signature(model.forward)
    hf_memo.apply(model)
    after = inspect.signature(model.forward)
    assert after == before
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in after.parameters.values())


def test_return_dict_false_gives_a_tuple_with_the_loss_first(family):
    model = build_model(family)
    hf_memo.apply(model, lm_head_chunks=2)
    ids, labels = make_batch(1, 9)
    out = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].ndim == 0


HIDDEN_STATE_MODES = [("none", None), ("full", None), ("selective", None), ("memo", 0.5)]


@pytest.mark.parametrize("recompute,alpha", HIDDEN_STATE_MODES, ids=[m for m, _ in HIDDEN_STATE_MODES])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_training_hidden_states_are_transformers_own(family, recompute, alpha):
    model, reference = model_pair(family)
    extra = {} if alpha is None else {"offload_fraction": alpha}
    hf_memo.apply(model, recompute=recompute, mlp_chunks=3, lm_head_chunks=4, **extra)
    ids, labels = make_batch(2, 13)
    last_layer = reference.transformer.h[-1] if family == "gpt2" else reference.model.layers[-1]
    pre_norm = []
    last_layer.register_forward_hook(lambda _module, _args, output: pre_norm.append(output.detach()))
    got = model(input_ids=ids, labels=labels, output_hidden_states=True)
    want = reference(input_ids=ids, labels=labels, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) == model.config.num_hidden_layers + 1
    for mine, theirs in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    # The chunked head keeps the final norm's input, not the normed hidden states.
    (kept, *_params) = got.loss.grad_fn.saved_tensors
    torch.testing.assert_close(kept, pre_norm[0].reshape(kept.shape), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    # The returned hidden states are differentiable like transformers' own (the loss's gradients are tested
    # by the other tests; its float32 backward would round a sum with these).
    for out in (got, want):
        (out.hidden_states[-1].square().mean() + out.hidden_states[1].sum() / 7).backward()
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def test_hidden_states_selected_by_index_pass_through(family):
    model, reference = model_pair(family)
    hf_memo.apply(model, lm_head_chunks=3)
    ids, labels = make_batch(2, 9)
    got = model(input_ids=ids, labels=labels, output_hidden_states=[0, -1]).hidden_states
    want = reference(input_ids=ids, labels=labels, output_hidden_states=[0, -1]).hidden_states
    assert [h is None for h in got] == [h is None for h in want]
    for mine, theirs in zip(got, want):
        if theirs is not None:
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
