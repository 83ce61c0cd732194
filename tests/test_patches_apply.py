import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForSequenceClassification, OPTConfig, OPTForCausalLM

import hf_memo
from hf_memo.config import MemoConfig
from hf_memo.patches.installed import InstalledForward
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from tests.conftest import assert_same_grads, build_model, make_batch, model_pair


def _train_step(model, ids, labels):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_apply_returns_the_same_model_and_records_the_config():
    model = build_model("llama")
    assert hf_memo.applied_config(model) is None
    assert hf_memo.apply(model, mlp_chunks=3) is model
    assert hf_memo.applied_config(model) == MemoConfig(mlp_chunks=3)


def test_applying_twice_is_a_no_op():
    model = build_model("llama")
    hf_memo.apply(model, mlp_chunks=3)
    forwards = [m.__dict__.get("forward") for m in model.modules()]
    hf_memo.apply(model)
    hf_memo.apply(model, MemoConfig(mlp_chunks=3))
    assert [m.__dict__.get("forward") for m in model.modules()] == forwards


def test_applying_a_different_config_repatches():
    model = build_model("llama")
    hf_memo.apply(model, mlp_chunks=3)
    hf_memo.apply(model, lm_head_chunks=5)
    assert hf_memo.applied_config(model) == MemoConfig(mlp_chunks=3, lm_head_chunks=5)
    hf_memo.revert(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_revert_restores_bitwise_identical_behaviour(family):
    model, reference = model_pair(family)
    ids, labels = make_batch(2, 13)
    hf_memo.apply(model, mlp_chunks=3, lm_head_chunks=3)
    _train_step(model, ids, labels)
    hf_memo.revert(model)
    assert hf_memo.applied_config(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())
    loss, grads = _train_step(model, ids, labels)
    ref_loss, ref_grads = _train_step(reference, ids, labels)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert hf_memo.revert(model) is model  # reverting an unpatched model is harmless


def test_checkpoint_of_a_patched_model_loads_into_plain_transformers(family, tmp_path):
    model = build_model(family)
    hf_memo.apply(model, mlp_chunks=3, lm_head_chunks=2)
    ids, labels = make_batch(1, 9)
    _train_step(model, ids, labels)
    model.save_pretrained(tmp_path / "patched")
    hf_memo.revert(model).save_pretrained(tmp_path / "plain")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "patched", dtype=torch.float64).eval()
    twin = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float64).eval()
    assert type(loaded) is type(model) and hf_memo.applied_config(loaded) is None
    assert "hf_memo" not in (tmp_path / "patched" / "config.json").read_text()
    original = model.state_dict()
    assert set(loaded.state_dict()) == set(original)
    assert all(torch.equal(t, original[n]) for n, t in loaded.state_dict().items())
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
        assert torch.equal(logits, twin(input_ids=ids).logits)
        torch.testing.assert_close(logits, model.eval()(input_ids=ids).logits, rtol=1e-12, atol=1e-12)


def test_deepcopy_of_a_patched_model_is_independent():
    model = build_model("llama")
    hf_memo.apply(model, mlp_chunks=2, lm_head_chunks=2)
    clone = copy.deepcopy(model)
    assert hf_memo.applied_config(clone) == hf_memo.applied_config(model)
    ids, labels = make_batch(1, 9)
    clone.zero_grad()
    clone(input_ids=ids, labels=labels).loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in clone.parameters())


def test_deepcopy_of_a_memo_model_gets_its_own_runtime_and_forwards_bound_to_the_copy():
    """A reference model copied from a patched one (as TRL's reference models are): the copy's installed forwards
    are bound to the copy, its memo runtime and its final-norm flag, none of them the original's."""
    model, reference = model_pair("llama", num_hidden_layers=4)
    hf_memo.apply(model, recompute="memo", mlp_chunks=3, offload_fraction=0.5, planner="greedy")
    hf_memo.memo_runtime(model).assume_policy(MemoryPolicy((LayerPolicy(False, True, 0.5),) * 2 + (LayerPolicy(),) * 2))
    ids, labels = make_batch(2, 16)
    _train_step(model, ids, labels)
    clone = copy.deepcopy(model)
    runtime, copied = hf_memo.memo_runtime(model), hf_memo.memo_runtime(clone)
    assert copied is not runtime and copied.assumed_policy == runtime.assumed_policy and copied.plan is None
    bound = [m.forward.impl.args for m in clone.modules() if isinstance(m.__dict__.get("forward"), InstalledForward)]
    originals = {id(model), id(runtime)} | {id(m) for m in model.modules()}
    assert bound and not any(id(arg) in originals for args in bound for arg in args)
    calls = runtime.attention_calls
    loss, grads = _train_step(clone, ids, labels)
    ref_loss, ref_grads = _train_step(reference, ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-8, atol=1e-11, msg=name)
    assert runtime.attention_calls == calls and copied.attention_calls == 4 + 2  # X-only layers: twice
    assert copied.memory_plan is not None and copied.memory_plan is not runtime.memory_plan


@pytest.mark.parametrize("apply_before_peft", [False, True])
def test_lora_model_matches_unpatched_lora(apply_before_peft):
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
        lora_dropout=0.0,
        modules_to_save=["lm_head"],
    )
    model, reference = model_pair("llama")
    if apply_before_peft:
        hf_memo.apply(model, mlp_chunks=3, lm_head_chunks=4)
    torch.manual_seed(5)
    model = get_peft_model(model, lora)
    torch.manual_seed(5)
    reference = get_peft_model(reference, lora)
    if not apply_before_peft:
        assert hf_memo.apply(model, mlp_chunks=3, lm_head_chunks=4) is model
    for m in (model, reference):  # non-zero B so LoRA gradients reach every adapter matrix
        for name, p in m.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(hash(name) % 1000))
    ids, labels = make_batch(2, 17)
    loss, grads = _train_step(model, ids, labels)
    ref_loss, ref_grads = _train_step(reference, ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    assert any("lora_A" in n for n in grads) and any("modules_to_save" in n for n in grads)
    assert_same_grads(model, reference)


def test_a_model_whose_layers_hf_memo_cannot_find_is_refused_with_what_it_looked_for():
    model = OPTForCausalLM(
        OPTConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=1,
            ffn_dim=32,
            num_attention_heads=2,
            word_embed_proj_dim=16,
        )
    )
    with pytest.raises(ValueError, match=r"cannot patch OPTForCausalLM .*found no list of 1 decoder"):
        hf_memo.apply(model)


def test_non_causal_lm_of_a_supported_family_is_refused():
    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, pad_token_id=0
    )
    with pytest.raises(ValueError, match="LlamaForSequenceClassification .*no LM head"):
        hf_memo.apply(LlamaForSequenceClassification(config))


def test_not_a_model_is_a_type_error():
    with pytest.raises(TypeError, match="expects a transformers PreTrainedModel"):
        hf_memo.apply(torch.nn.Linear(2, 2))


def test_bad_overrides_raise_value_errors():
    model = build_model("llama")
    with pytest.raises(ValueError, match="MemoConfig.mlp_chunks must be"):
        hf_memo.apply(model, mlp_chunks=0)
    with pytest.raises(ValueError, match="unknown MemoConfig field"):
        hf_memo.apply(model, chunk_count=3)
    assert hf_memo.applied_config(model) is None


@pytest.mark.usefixtures("self_check_off")
def test_revert_keeps_a_forward_wrapped_after_apply_and_makes_it_plain():
    """As TRL does, a library wraps ``model.forward`` after hf_memo patched it: revert leaves the wrapper in place
    (dropping it would lose that library's behaviour) and the wrapper then reaches the unpatched forward."""
    model, reference = model_pair("llama")
    hf_memo.apply(model, mlp_chunks=3, lm_head_chunks=3)
    patched, calls = model.forward, []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return patched(*args, **kwargs)

    model.forward = wrapper
    ids, labels = make_batch(2, 13)
    assert model(input_ids=ids, labels=labels).logits is None  # the chunked head keeps no logits in training
    hf_memo.revert(model)
    assert model.forward is wrapper and hf_memo.applied_config(model) is None
    out = model(input_ids=ids, labels=labels)
    want = reference(input_ids=ids, labels=labels)
    assert len(calls) == 2 and torch.equal(out.logits, want.logits) and torch.equal(out.loss, want.loss)
    hf_memo.apply(model, mlp_chunks=3)  # patching again wraps the wrapper, and still computes the same loss
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, want.loss, rtol=1e-6, atol=0)
