"""Packed and padded training batches in every recompute mode against the unpatched Hugging Face model.

A packed row (samples of odd lengths, ``position_ids`` restarting, the first label of each sample
-100 as ``DataCollatorWithFlattening`` writes it) must give the loss and every gradient of running
each sample alone through the unpatched model (with the packed batch's ``num_items_in_batch``); a
left- or right-padded batch those of the unpatched model with its attention mask. The config's
default ``use_cache=True`` is left in place: a training step must still keep samples apart.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import hf_memo
from hf_memo.patches.apply import memo_runtime
from hf_memo.patches.packing import describe_training_batch
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.runtime.batch_layout import LAYOUT_KEYWORD
from tests.conftest import VOCAB, ShapeRecorder, assert_same_grads, build_model
from tests.test_patches_forwards_layers import OpCounter

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off")

MODES = [
    ("none", None),
    ("full", None),
    ("selective", None),
    ("memo", 0.0),
    ("memo", 0.5),
    ("memo", 1.0),
]
LENGTHS = (5, 9, 3, 7)


def _apply(model, recompute, alpha):
    extra = {} if alpha is None else {"offload_fraction": alpha}
    return hf_memo.apply(model, recompute=recompute, mlp_chunks=3, lm_head_chunks=2, **extra)


def packed_row(lengths=LENGTHS, seed=0):
    """``(samples, labels, ids (1, S), packed labels (1, S), position_ids (1, S), num_items)``."""
    gen = torch.Generator().manual_seed(seed)
    samples = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    labels = [s.clone() for s in samples]
    labels[1][2] = labels[1][5] = -100
    labels[-1][-1] = -100
    packed_labels = torch.cat([torch.cat([torch.tensor([-100]), label[1:]]) for label in labels])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    num_items = torch.tensor(sum(int((label[1:] != -100).sum()) for label in labels))
    return samples, labels, torch.cat(samples)[None], packed_labels, positions, num_items


def padded_batch(side: str, seed=1):
    """``(ids, labels, attention_mask)`` ``(3, 10)``: rows of 10, 6 and 8 real tokens padded on ``side``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    for row, real in ((1, 6), (2, 8)):
        pads = slice(real, None) if side == "right" else slice(None, 10 - real)
        mask[row, pads] = 0
        ids[row, pads] = 0
    labels = ids.masked_fill(mask == 0, -100)  # left: the last padding token still predicts the first real one
    labels[0, 4] = -100
    return ids, labels, mask


def assert_packed_row_equals_samples_alone(model, reference):
    """One step of ``model`` on :func:`packed_row` gives the loss and gradients of ``reference`` run on each sample."""
    samples, labels, ids, packed_labels, positions, num_items = packed_row()
    got = _step(model, input_ids=ids, labels=packed_labels, position_ids=positions, num_items_in_batch=num_items)
    want = sum(
        _step(reference, input_ids=sample[None], labels=label[None], num_items_in_batch=num_items)
        for sample, label in zip(samples, labels)
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def _step(model, **batch):
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def _layers(family):
    return {"n_layer": 3} if family == "gpt2" else {"num_hidden_layers": 3}


@pytest.mark.parametrize("recompute,alpha", MODES, ids=[f"{m}-{a}" for m, a in MODES])
def test_packed_row_equals_the_samples_run_alone(family, recompute, alpha):
    reference = build_model(family, **_layers(family))
    model = _apply(copy.deepcopy(reference), recompute, alpha)
    assert_packed_row_equals_samples_alone(model, reference)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("recompute,alpha", MODES, ids=[f"{m}-{a}" for m, a in MODES])
def test_padded_batch_equals_unpatched_with_its_mask(family, recompute, alpha, side):
    reference = build_model(family, **_layers(family))
    model = _apply(copy.deepcopy(reference), recompute, alpha)
    ids, labels, mask = padded_batch(side)
    got = _step(model, input_ids=ids, labels=labels, attention_mask=mask)
    want = _step(reference, input_ids=ids, labels=labels, attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("recompute,alpha", [("none", None), ("selective", None), ("memo", 0.5)])
def test_a_training_forward_without_labels_keeps_packed_samples_apart(recompute, alpha):
    """A trainer with its own LM head (TRL's ``fused_lm_head``) calls the backbone without labels: the backbone's
    hidden states of a packed row are each sample's, and gradients through them are the samples' own."""
    reference = build_model("llama", num_hidden_layers=3)
    model = _apply(copy.deepcopy(reference), recompute, alpha)
    samples, _, ids, _, positions, _ = packed_row()
    hidden = model.model(input_ids=ids, position_ids=positions).last_hidden_state
    weights = torch.randn_like(hidden)
    (hidden * weights).sum().backward()
    offsets = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    want = []
    for sample, start, stop in zip(samples, offsets, offsets[1:]):
        rows = reference.model(input_ids=sample[None]).last_hidden_state
        (rows * weights[:, start:stop]).sum().backward()
        want.append(rows.detach())
    torch.testing.assert_close(hidden.detach(), torch.cat(want, dim=1), rtol=1e-10, atol=1e-12)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def right_padded_with_targets(seed=2):
    """``(ids, labels, attention_mask)`` ``(4, 10)`` as transformers' model tests write them (``labels = input_ids``,
    padding after the real tokens): rows of 4, 10 (no padding) and 7 real tokens, and one of 5 real tokens after 2
    of left padding; the padding after the real tokens has targets, the one before them is labelled -100."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (4, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 4:] = mask[2, 7:] = mask[3, :2] = mask[3, 7:] = 0
    labels = ids.clone()
    labels[3, :2] = -100
    return ids, labels, mask


POLICY_MODES = [*MODES, ("memo", "policy")]


def _apply_mode(model, recompute, alpha):
    """:func:`_apply`; alpha ``"policy"``: memo with layers that keep their attention output or do not."""
    if alpha != "policy":
        return _apply(model, recompute, alpha)
    model = _apply(model, "memo", 0.5)
    layers = (
        LayerPolicy(keep_attention=False, on_host=True, alpha=0.5),
        LayerPolicy(keep_attention=True, on_host=True, alpha=0.0),
        LayerPolicy(keep_attention=False, on_host=False, alpha=1.0),
    )
    memo_runtime(model).assume_policy(MemoryPolicy(layers))
    return model


@pytest.mark.parametrize("recompute,alpha", POLICY_MODES, ids=[f"{m}-{a}" for m, a in POLICY_MODES])
def test_right_padding_with_targets_trains_as_transformers_does(family, recompute, alpha):
    """transformers' model tests label right padding (``labels = input_ids`` with a lower-triangular mask): its
    padding queries attend to all the real tokens before them, and the loss trains them."""
    reference = build_model(family, **_layers(family))
    model = _apply_mode(copy.deepcopy(reference), recompute, alpha)
    ids, labels, mask = right_padded_with_targets()
    got = _step(model, input_ids=ids, labels=labels, attention_mask=mask)
    want = _step(reference, input_ids=ids, labels=labels, attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("alpha", [0.5, "policy"])
def test_memo_right_padding_with_targets_and_ignored_padding_in_one_batch(alpha):
    """Rows whose padding is labelled -100 beside rows whose padding has targets, and the tester's own batch shape
    (a lower-triangular mask): memo attends the trained padding as transformers does and leaves the rest alone."""
    reference = build_model("qwen3", num_hidden_layers=3)
    model = _apply_mode(copy.deepcopy(reference), "memo", alpha)
    ids = torch.randint(3, VOCAB, (5, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.tril(torch.ones(7, 7, dtype=torch.int64))[[0, 2, 3, 5, 6]]
    labels = ids.clone()
    labels[1, 3:] = -100
    labels[2, 1] = -100
    got = _step(model, input_ids=ids, labels=labels, attention_mask=mask)
    want = _step(reference, input_ids=ids, labels=labels, attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("implementation,attends", [("sdpa", True), ("eager", True), ("flash_attention_2", False)])
def test_padding_attends_where_the_models_attention_lets_it(implementation, attends):
    """transformers' flash-attention path unpads the batch (padding queries get nothing); eager and sdpa masks let
    trained padding attend to its sample."""
    config = SimpleNamespace(_attn_implementation=implementation)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=implementation, get_text_config=lambda: config))
    ids, labels, mask = right_padded_with_targets()
    arguments = describe_training_batch(model, {"input_ids": ids, "attention_mask": mask}, labels, {})
    assert arguments[LAYOUT_KEYWORD].padding_attends is attends
    assert arguments[LAYOUT_KEYWORD].rows == (((0, 4),), ((0, 10),), ((0, 7),), ((2, 7),))


def test_padding_with_targets_is_refused_where_attention_runs_per_sample():
    """Sequence parallelism attends per sample after its exchange, where padding gets no attention."""
    model = build_model("llama", num_hidden_layers=2)
    ids, labels, mask = right_padded_with_targets()
    with pytest.raises(ValueError, match="sequence parallelism .* ignore index"):
        describe_training_batch(model, {"input_ids": ids, "attention_mask": mask}, labels, {}, per_sample=True)


def test_a_cache_asked_for_in_a_training_step_still_keeps_samples_apart():
    reference = build_model("llama")
    model = _apply(copy.deepcopy(reference), "memo", 0.5)
    samples, labels, ids, packed_labels, positions, num_items = packed_row()
    got = model(input_ids=ids, labels=packed_labels, position_ids=positions, use_cache=True).loss
    reference.config.use_cache = False
    want = reference(input_ids=ids, labels=packed_labels, position_ids=positions).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_an_all_ones_mask_does_not_hide_packed_samples():
    reference = build_model("qwen3")
    model = _apply(copy.deepcopy(reference), "selective", None)
    samples, labels, ids, packed_labels, positions, num_items = packed_row()
    got = _step(model, input_ids=ids, labels=packed_labels, position_ids=positions, attention_mask=torch.ones_like(ids))
    want = _step(reference, input_ids=ids, labels=packed_labels, position_ids=positions, use_cache=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("recompute,alpha", [("none", None), ("selective", None), ("memo", 0.5)])
def test_packed_samples_then_padding_equal_the_samples_run_alone(recompute, alpha):
    reference = build_model("qwen2")
    model = _apply(copy.deepcopy(reference), recompute, alpha)
    samples, labels, ids, packed_labels, positions, num_items = packed_row()
    pad = torch.zeros(1, 5, dtype=torch.long)
    mask = torch.cat([torch.ones_like(ids), pad], dim=1)
    got = _step(
        model,
        input_ids=torch.cat([ids, pad], dim=1),
        labels=torch.cat([packed_labels, pad - 100], dim=1),
        position_ids=torch.cat([positions, torch.arange(5)[None]], dim=1),
        attention_mask=mask,
        num_items_in_batch=num_items,
    )
    want = sum(
        _step(reference, input_ids=sample[None], labels=label[None], num_items_in_batch=num_items)
        for sample, label in zip(samples, labels)
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("recompute,alpha", [("none", None), ("memo", 0.5)])
def test_packed_samples_with_padding_are_refused_where_transformers_masks_would_be_used(recompute, alpha):
    model = _apply(build_model("llama", attn_implementation="eager"), recompute, alpha)
    _, _, ids, packed_labels, positions, _ = packed_row()
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    packed_labels[0, -3:] = -100
    with pytest.raises(ValueError, match="transformers' masks let the packed samples attend to each other"):
        model(input_ids=ids, labels=packed_labels, position_ids=positions, attention_mask=mask)
    assert all(p.grad is None for p in model.parameters())


def test_packed_samples_with_an_attention_that_ignores_them_are_refused():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("test_positionless", sdpa_attention_forward)  # gets no mask from transformers
    model = _apply(build_model("llama", attn_implementation="test_positionless"), "full", None)
    _, _, ids, packed_labels, positions, _ = packed_row()
    with pytest.raises(ValueError, match="attn_implementation='test_positionless' ignores"):
        model(input_ids=ids, labels=packed_labels, position_ids=positions)


def test_memo_sliding_window_is_checked_against_the_longest_sample():
    reference = build_model("mistral", sliding_window=10)
    model = _apply(copy.deepcopy(reference), "memo", 0.5)
    samples, labels, ids, packed_labels, positions, num_items = packed_row()  # 24 tokens, samples of at most 9
    got = _step(model, input_ids=ids, labels=packed_labels, position_ids=positions)
    want = _step(reference, input_ids=ids, labels=packed_labels, position_ids=positions, use_cache=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


@pytest.mark.usefixtures("self_check_off")
def test_per_sample_attention_runs_one_kernel_call_per_sample_and_layer_and_builds_no_mask():
    model = _apply(build_model("llama", num_hidden_layers=3), "none", None)
    _, _, ids, packed_labels, positions, _ = packed_row()
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with OpCounter(flash) as counter, ShapeRecorder() as shapes:
        model(input_ids=ids, labels=packed_labels, position_ids=positions)
    assert counter.counts[flash] == 3 * len(LENGTHS)
    assert all(shape[-2:] != (ids.shape[1], ids.shape[1]) for shape in shapes.shapes)  # no S x S mask


def test_eager_attention_keeps_transformers_masks_for_packed_and_padded_batches():
    reference = build_model("gpt2", attn_implementation="eager")
    model = _apply(copy.deepcopy(reference), "full", None)
    assert_packed_row_equals_samples_alone(model, reference)


def test_memo_refuses_padding_with_targets_that_reaches_past_the_sliding_window():
    """A row of 35 tokens, 8 real then padding whose labels are targets: transformers limits the padding queries to
    the window of 33, memo attends them to the whole sample, so it refuses; with the padding's labels at -100,
    or with a window covering the row, memo is exact."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, 35), generator=gen)
    mask = torch.zeros_like(ids)
    mask[:, :8] = 1
    for window, padding_labels, exact in ((33, "targets", False), (33, "-100", True), (35, "targets", True)):
        reference = build_model("mistral", num_hidden_layers=1, sliding_window=window)
        model = _apply(copy.deepcopy(reference), "memo", 0.5)
        labels = ids.clone()
        if padding_labels == "-100":
            labels[mask == 0] = -100
        if not exact:
            with pytest.raises(ValueError, match="sliding window of 33 tokens and padding with targets .* over 35"):
                model(input_ids=ids, labels=labels, attention_mask=mask)
            continue
        got = _step(model, input_ids=ids, labels=labels, attention_mask=mask)
        want = _step(reference, input_ids=ids, labels=labels, attention_mask=mask)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
