"""The exactness matrix: every catalog model (``tests/model_catalog.py``) under every recompute mode trains
exactly like the unpatched model (fp64).

One step per cell: batch 2 of 29 tokens (windows of 8 really cut them), ~30% of the labels -100, a 2-D
``attention_mask`` padding one row, ``mlp_chunks = lm_head_chunks = 3`` (they do not divide 29). Every
parameter gradient, the loss and the router ``aux_loss`` of mixture-of-experts models must equal the unpatched
model's: gradients to rtol 1e-9 / atol 1e-12 (``assert_same_grads``), or to ``FP32_TOLERANCE`` of each
gradient's largest element where the model computes in fp32 inside (``CatalogModel.fp32_rounded``); the losses,
which transformers computes in fp32 even for fp64 models, to an fp32 rounding. Also: gradient accumulation over
two micro-batches, and patching Llama after its modeling module is reloaded.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
import transformers
from transformers import PreTrainedModel
from transformers.models.llama import modeling_llama

import hf_memo
from hf_memo.config import MemoConfig
from hf_memo.patches.structure import describe
from tests.conftest import assert_same_grads, build_model, make_batch
from tests.model_catalog import CATALOG, CATALOG_NAMES, FP32_TOLERANCE, WINDOW, build_catalog_model

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off")

SEQ = 29
CHUNKS = 3
LOSS_RTOL = 1e-6  # the losses are fp32 scalars (see assert_same_outputs)
MODES: dict[str, dict[str, Any]] = {
    "none": {"recompute": "none"},
    "full": {"recompute": "full"},
    "selective": {"recompute": "selective"},
    "memo-0.5": {"recompute": "memo", "offload_fraction": 0.5},
    "memo-1.0": {"recompute": "memo", "offload_fraction": 1.0},
}


def _inputs(name: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """Batch 2 of ``SEQ`` tokens, row 1 padded.

    Most get 11 padding tokens on the left. Models whose eager attention rounds its softmax through fp32 get
    fewer than ``WINDOW`` on the right: there a fully masked query row becomes NaN in fp64 (the ``-finfo.max``
    mask turns ``-inf`` in fp32), which a left-padded row, or a right-padded one whose last window holds only
    padding, would have.
    """
    ids, labels = make_batch(2, SEQ, seed=seed)
    mask = torch.ones_like(ids)
    if CATALOG[name].fp32_softmax:
        mask[1, SEQ - (WINDOW - 3) :] = 0
    else:
        mask[1, :11] = 0
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@functools.cache
def _reference(name: str) -> tuple[PreTrainedModel, dict[str, torch.Tensor], Any, PreTrainedModel]:
    """``(pristine model, inputs, output, trained reference)`` of catalog entry ``name``, built once per worker:
    the reference ran one unpatched step on the inputs."""
    pristine = build_catalog_model(name)
    inputs = _inputs(name)
    reference = copy.deepcopy(pristine)
    out = reference(**inputs, use_cache=False)
    out.loss.backward()
    return pristine, inputs, out, reference


def assert_grads_within_fp32_rounding(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every gradient within ``FP32_TOLERANCE`` of the largest element of the reference's."""
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        ref = ref_params[name].grad
        assert (param.grad is None) == (ref is None), f"{name}: gradient present in only one model"
        if ref is not None:
            bound = FP32_TOLERANCE * float(ref.abs().max())
            torch.testing.assert_close(param.grad, ref, rtol=0, atol=bound, msg=lambda m, n=name: f"{n}: {m}")


def assert_same_outputs(name: str, out: Any, want: Any) -> None:
    """The patched model's loss (and router ``aux_loss``) equals the unpatched model's.

    Both are fp32 scalars in fp64 models (``ForCausalLMLoss`` upcasts the logits with ``.float()``; the router
    loss sums in fp32), whose sums chunks re-associate: they may differ by an fp32 rounding (~1.2e-7).
    """
    torch.testing.assert_close(out.loss.detach(), want.loss.detach(), rtol=LOSS_RTOL, atol=0)
    if CATALOG[name].moe:
        assert out.aux_loss is not None, "the patched model lost the router aux_loss"
        torch.testing.assert_close(out.aux_loss.detach(), want.aux_loss.detach(), rtol=LOSS_RTOL, atol=0)


def assert_grads_match(name: str, mode: str, model: PreTrainedModel, reference: PreTrainedModel) -> None:
    """Every gradient of the patched model equals the unpatched model's (to fp32 rounding where the model
    computes in fp32 inside: ``CatalogModel.fp32_rounded``)."""
    if CATALOG[name].fp32_rounded(MODES[mode]["recompute"]):
        assert_grads_within_fp32_rounding(model, reference)
    else:
        assert_same_grads(model, reference)


WINDOWED = {"mistral-window", "mistral-window-eager", "ministral", "mixtral", "mixtral-batched_mm", "gpt_oss",
            "gemma2", "gemma3_text", "gemma3_text-eager", "gemma3", "phi3", "olmo3", "cohere2", "smollm3",
            "starcoder2", "exaone4"}  # fmt: skip


@pytest.mark.parametrize("name", CATALOG_NAMES)
def test_catalog_model_has_its_windows_and_router_loss_switched_on(name):
    """The traits the matrix is meant to exercise are on: sliding windows shorter than the sequence, and the
    router loss in the loss of mixture-of-experts models."""
    _, _, out, reference = _reference(name)
    config = reference.config.get_text_config()
    holders = [config, *reference.modules()]  # windows are read from the config or kept on the attention modules
    windows = {getattr(holder, "sliding_window", None) for holder in holders}
    assert windows - {None, 0} == ({WINDOW} if name in WINDOWED else set())
    assert WINDOW < SEQ
    if CATALOG[name].moe:
        assert out.aux_loss is not None and config.output_router_logits and config.router_aux_loss_coef > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CATALOG_NAMES)
def test_patched_catalog_model_trains_like_the_unpatched_one(name, mode):
    pristine, inputs, want, reference = _reference(name)
    model = hf_memo.apply(copy.deepcopy(pristine), mlp_chunks=CHUNKS, lm_head_chunks=CHUNKS, **MODES[mode])
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    assert_grads_match(name, mode, model, reference)
    assert_same_outputs(name, out, want)


@pytest.mark.parametrize(("name", "mode"), [("gemma2", "memo-0.5"), ("qwen3_moe-mixed", "memo-1.0"),
                                            ("gpt_oss", "selective"), ("cohere2", "memo-0.5")])  # fmt: skip
def test_gradient_accumulation_over_two_micro_batches(name, mode):
    """Two micro-batches of different lengths, each loss over the step's token count (``num_items_in_batch``)."""
    reference = build_catalog_model(name)
    model = hf_memo.apply(copy.deepcopy(reference), mlp_chunks=CHUNKS, lm_head_chunks=CHUNKS, **MODES[mode])
    batches = [_inputs(name, seed=2), _inputs(name, seed=3)]
    batches[1] = {key: value[:, 3:] for key, value in batches[1].items()}  # 26 tokens, still padded
    items = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches))
    for batch in batches:
        out = model(**batch, num_items_in_batch=items, use_cache=False)
        out.loss.backward()
        want = reference(**batch, num_items_in_batch=items, use_cache=False)
        want.loss.backward()
        assert_same_outputs(name, out, want)
    assert_grads_match(name, mode, model, reference)


def test_fp32_tolerance_is_needed():
    """The loosened tolerance is what transformers' own eager and SDPA attention differ by, not more: eager
    Mistral (fp32 softmax) differs from SDPA Mistral beyond the tight tolerance and within ``FP32_TOLERANCE``."""
    _, inputs, _, eager = _reference("mistral-window-eager")
    sdpa = build_catalog_model("mistral-window")
    sdpa(**inputs, use_cache=False).loss.backward()
    with pytest.raises(AssertionError):
        assert_same_grads(sdpa, eager)
    assert_grads_within_fp32_rounding(sdpa, eager)


@pytest.fixture
def llama_module() -> Iterator[ModuleType]:
    """transformers' Llama modeling module, its names restored after the test (which may reload it), so other
    tests keep the classes they imported."""
    names = dict(vars(modeling_llama))
    yield modeling_llama
    hf_memo.patches.uninstall_from_class(modeling_llama.LlamaForCausalLM)
    vars(modeling_llama).update(names)


def _check_patched(model: PreTrainedModel, config: MemoConfig) -> None:
    """``model`` is patched with ``config`` (hf_memo's forward runs) and trains like its unpatched copy."""
    assert hf_memo.applied_config(model) == config and "forward" in vars(model), f"not patched: {type(model)}"
    reference = hf_memo.revert(copy.deepcopy(model))
    ids, labels = make_batch(2, SEQ)
    for each in (model, reference):
        each(input_ids=ids, labels=labels).loss.backward()
    assert_same_grads(model, reference)


def test_llama_is_patched_after_its_modeling_module_is_reloaded(llama_module):
    """After ``importlib.reload`` (IPython's autoreload) defines new Llama classes, ``hf_memo.apply`` patches a
    model of the new class and the class-level installer patches the new class's models, though hf_memo patched
    a model of the original class before."""
    config = CATALOG["llama"].config()
    before = hf_memo.apply(llama_module.LlamaForCausalLM(config).double(), mlp_chunks=CHUNKS)
    importlib.reload(llama_module)
    cls = llama_module.LlamaForCausalLM
    assert cls is not type(before)
    memo = MemoConfig(recompute="memo", mlp_chunks=CHUNKS, lm_head_chunks=CHUNKS)
    torch.manual_seed(0)
    _check_patched(hf_memo.apply(cls(config).double(), memo), memo)
    selective = MemoConfig(recompute="selective", mlp_chunks=CHUNKS)
    hf_memo.patches.apply_hf_memo_to_llama(selective)
    torch.manual_seed(0)
    _check_patched(cls(config).double(), selective)


REFUSALS = {
    "qwen3_next": (
        lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=4, pad_token_id=0, linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8)),
        "decoder layer 0 has no softmax self-attention .*hybrid layers",
    ),
    "chunked attention": (
        lambda: build_model("llama", attention_chunk_size=8),
        "chunked attention .*attention_chunk_size=8",
    ),
    "kv sharing": (
        lambda: build_model("llama", num_kv_shared_layers=1),
        r"layers that reuse .*\(KV sharing\) \(config\.num_kv_shared_layers=1",
    ),
    "encoder-decoder": (
        lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=101, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4)),
        "encoder-decoder models are not supported",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_cannot_be_patched_exactly_is_refused_with_the_model_and_the_reason(case):
    build, reason = REFUSALS[case]
    model = build()
    with pytest.raises(ValueError, match=f"hf_memo cannot patch {type(model).__name__} .*: {reason}"):
        hf_memo.apply(model)
    assert hf_memo.applied_config(model) is None


def test_a_vision_tower_as_deep_as_the_text_decoder_is_not_taken_for_it():
    """Gemma 3's multimodal class with a SigLIP encoder of as many layers as the text decoder: the decoder layers are
    the text model's (they were the vision encoder's, found first, and the model was refused for want of a norm)."""
    config = CATALOG["gemma3"].config()
    config.vision_config.num_hidden_layers = config.text_config.num_hidden_layers
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).double()
    structure = describe(model)
    assert structure.layers == list(model.model.language_model.layers)
    assert structure.final_norm == "model.language_model.norm"
