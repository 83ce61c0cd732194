"""Hugging Face gradient checkpointing under hf_memo's recompute modes, against the unpatched model."""

import copy
import logging

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import LlamaForCausalLM

import hf_memo
from hf_memo.patches import apply_hf_memo_to_llama, uninstall_from_class
from hf_memo.patches.apply import memo_runtime
from tests.conftest import assert_same_grads, build_model, make_batch
from tests.test_patches_forwards_layers import LAYERS, OpCounter, _apply, _build, _step

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off")


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


@pytest.mark.parametrize("recompute,alpha", [("selective", None), ("memo", 0.5)])
def test_transformers_offloading_checkpoint_function_is_taken_over_too(recompute, alpha):
    """``activation_checkpointing_enable(offload=True)`` sets transformers' own wrapper of ``checkpoint``: it is
    Hugging Face checkpointing, which hf_memo's mode replaces (attention runs as often as without it)."""
    model = _build("llama")
    reference = copy.deepcopy(model)
    _apply(model, recompute, alpha)
    model.activation_checkpointing_enable(offload=True)
    _step(model, *make_batch(2, 19, seed=2))  # the first step calibrates memo
    model.zero_grad()
    ids, labels = make_batch(2, 19)
    loss, runs = _attention_runs(model, ids, labels)
    assert runs == LAYERS
    torch.testing.assert_close(loss, _step(reference, ids, labels), rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("recompute,alpha", [("full", None), ("selective", None), ("memo", 0.5)])
def test_a_checkpoint_function_of_ones_own_is_called_in_place_of_hf_memos(recompute, alpha):
    model = _build("llama")
    reference = copy.deepcopy(model)
    _apply(model, recompute, alpha)
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


def test_memo_leaves_a_layer_with_a_checkpoint_function_of_its_own_to_it_and_checkpoints_nothing_twice(caplog):
    """As transformers' ``test_training_gradient_checkpointing`` does: a spying checkpoint function on the first
    layer. It is called once and runs that layer twice (forward, recomputation); the other layers run under the
    executor, which never runs attention again: attention runs once per layer plus the one recomputation."""
    model = _build("llama")
    reference = copy.deepcopy(model)
    _apply(model, "memo", 0.5)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    first = model.model.layers[0]
    hf_checkpoint, calls, forwards = first._gradient_checkpointing_func, [], []

    def spying_checkpoint(function, *args):
        calls.append(len(args))
        return hf_checkpoint(lambda *a: forwards.append(1) or function(*a), *args)

    first._gradient_checkpointing_func = spying_checkpoint
    _step(model, *make_batch(2, 19, seed=2))  # the first step calibrates memo
    model.zero_grad()
    calls.clear(), forwards.clear()
    runtime = memo_runtime(model)
    runtime.attention_calls = 0
    ids, labels = make_batch(2, 19)
    with caplog.at_level(logging.WARNING, logger="hf_memo.patches.hf_checkpointing"):
        loss, runs = _attention_runs(model, ids, labels)
    assert calls == [1] and len(forwards) == 2 and runs == LAYERS + 1
    assert runtime.attention_calls == LAYERS - 1
    assert [r.levelno for r in caplog.records if "checkpoint function of its own" in r.getMessage()] == [
        logging.WARNING
    ]
    torch.testing.assert_close(loss, _step(reference, ids, labels), rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
    assert runtime.device_buffer_bytes == 0  # the prefetch buffers went after layer 1, the lowest memo ran


def test_models_built_with_checkpointing_in_their_config_are_patched_at_construction():
    apply_hf_memo_to_llama(recompute="selective", mlp_chunks=3)
    try:
        model = build_model("llama", num_hidden_layers=LAYERS, gradient_checkpointing=True)
    finally:
        uninstall_from_class(LlamaForCausalLM)
    assert model.is_activation_checkpointing and hf_memo.applied_config(model).recompute == "selective"
    reference = copy.deepcopy(model)
    hf_memo.revert(reference)
    ids, labels = make_batch(2, 13)
    torch.testing.assert_close(_step(model, ids, labels), _step(reference, ids, labels), rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
