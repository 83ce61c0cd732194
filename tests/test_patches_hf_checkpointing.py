"""Hugging Face gradient checkpointing under hf_memo's recompute modes, against the unpatched model."""

import copy
import logging

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hf_memo
from hf_memo.patches import FAMILIES, apply_hf_memo_to_llama, uninstall_from_class
from tests.conftest import assert_same_grads, build_model, make_batch
from tests.test_patches_forwards_layers import LAYERS, OpCounter, _apply, _build, _step


def _attention_runs(model, ids, labels):
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with OpCounter(flash) as counter:
        loss = _step(model, ids, labels)
    return loss, counter.counts[flash]


@pytest.mark.parametrize("enable", ["before-apply", "after-apply"])
@pytest.mark.parametrize("recompute,alpha", [("full", None), ("selective", None), ("memo", 0.5)])
def test_recompute_modes_take_layers_over_from_hf_checkpointing(recompute, alpha, enable, caplog):
    model = _build("llama")
    reference = copy.deepcopy(model)
    plain = _apply(copy.deepcopy(model), recompute, alpha)
    if enable == "before-apply":
        model.gradient_checkpointing_enable()
    with caplog.at_level(logging.INFO, logger="hf_memo.patches.hf_checkpointing"):
        _apply(model, recompute, alpha)
        if enable == "after-apply":
            model.gradient_checkpointing_enable()
        _step(model, *make_batch(2, 19, seed=2))  # the first step calibrates memo; later steps log nothing more
        model.zero_grad()
        ids, labels = make_batch(2, 19)
        loss, runs = _attention_runs(model, ids, labels)
    _step(plain, *make_batch(2, 19, seed=2))
    assert model.is_gradient_checkpointing  # Hugging Face's flag stays set
    takeovers = [r for r in caplog.records if "recomputes the decoder layers instead" in r.getMessage()]
    assert len(takeovers) == 1 and takeovers[0].levelno == logging.INFO
    # No layer is checkpointed twice: attention runs as often as without Hugging Face's flag
    # (full: forward + one recomputation; selective keeps attention's output; memo never recomputes it).
    assert runs == _attention_runs(plain, ids, labels)[1] == (2 if recompute == "full" else 1) * LAYERS
    reference_loss = _step(reference, ids, labels)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def test_hf_checkpointing_keeps_checkpointing_under_recompute_none():
    model = hf_memo.apply(_build("llama"), recompute="none")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert _attention_runs(model, *make_batch(2, 19))[1] == 2 * LAYERS


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_a_checkpoint_function_of_ones_own_is_called_in_place_of_hf_memos(recompute):
    model = _build("llama")
    reference = copy.deepcopy(model)
    _apply(model, recompute, None)
    model.gradient_checkpointing_enable()
    calls, forwards = [], []

    def counting_checkpoint(function, *args):
        calls.append(len(args))
        return checkpoint(lambda *a: forwards.append(1) or function(*a), *args, use_reentrant=False)

    for layer in model.model.layers:
        layer._gradient_checkpointing_func = counting_checkpoint
    ids, labels = make_batch(2, 19)
    torch.testing.assert_close(_step(model, ids, labels), _step(reference, ids, labels), rtol=1e-6, atol=0)
    assert calls == [1] * LAYERS  # once per layer, the hidden states positionally
    assert len(forwards) == 2 * LAYERS  # its forward and its recomputation: no second checkpoint inside
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def test_models_built_with_checkpointing_in_their_config_are_patched_at_construction():
    family = FAMILIES["llama"]
    apply_hf_memo_to_llama(recompute="selective", mlp_chunks=3)
    try:
        model = build_model("llama", num_hidden_layers=LAYERS, gradient_checkpointing=True)
    finally:
        uninstall_from_class(family)
    assert model.is_activation_checkpointing and hf_memo.applied_config(model).recompute == "selective"
    reference = copy.deepcopy(model)
    hf_memo.revert(reference)
    ids, labels = make_batch(2, 13)
    torch.testing.assert_close(_step(model, ids, labels), _step(reference, ids, labels), rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
