"""The self-check (hf_memo/patches/self_check.py): the patched model against the unpatched one at the first step."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

import hf_memo
from hf_memo.patches import self_check
from hf_memo.patches.patching import patch_state
from hf_memo.patches.sample_attention import attends_per_sample
from tests.conftest import VOCAB, build_model, make_batch
from tests.model_catalog import CATALOG_NAMES, FP32_TOLERANCE, WINDOW, build_catalog_model

SEQ = 29
_SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "pad_token_id": 0}
_GQA = {**_SMALL, "intermediate_size": 48, "num_key_value_heads": 2}
# Gemma 4: a heterogeneous config (its full-attention layer's heads twice as wide as its sliding layer's), with
# per-layer input embeddings passed to each layer beside its hidden states
_GEMMA4 = {
    **_GQA,
    "head_dim": 8,
    "per_layer_config": {1: {"head_dim": 16}},
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": WINDOW,
}
# Families outside the catalog whose layers take another path than the catalog's: attention that branches on the
# implementation's name (Falcon), masks built inside the layer (Doge), layers that do not pass keyword arguments on
# (Falcon, Bloom, MPT), MLPs with a residual argument (Bloom, MPT), parts under other names (GPT-NeoX, MPT),
# parameterless norms (OLMo), a mixture of attention heads (JetMoe), a complex rotary table (Llama 4), a norm before
# the output projection (BitNet), the attention inside a norm-attention-norm block (DBRX), a residual taken after the
# input norm and a linear-attention layer (MiniMax), the final norm called on the embeddings too (NanoChat), two
# attention calls per layer with the same queries and keys (DiffLlama), layer outputs with a leading axis of AltUp
# predictions (k, B, S, H) and per-layer MLP widths (Gemma-3n, without its KV sharing, which is refused), per-layer
# head widths (Gemma 4), attention computed in the layer's own code (GPT-Neo, global and local layers), a recurrent
# block whose forward names its input ``hidden`` (RWKV).
FAMILIES = {
    "falcon": ("FalconConfig", _SMALL),
    "falcon-new": ("FalconConfig", {**_SMALL, "new_decoder_architecture": True, "num_kv_heads": 2}),
    "doge": ("DogeConfig", _GQA),
    "stablelm": ("StableLmConfig", _GQA),
    "nemotron": ("NemotronConfig", _GQA),
    "bloom": ("BloomConfig", {"vocab_size": VOCAB, "hidden_size": 32, "n_layer": 2, "n_head": 4, "pad_token_id": 0}),
    "mpt": ("MptConfig", {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4, "pad_token_id": 0}),
    "gpt_neox": ("GPTNeoXConfig", {**_SMALL, "intermediate_size": 48}),
    "olmo": ("OlmoConfig", _GQA),
    "jetmoe": ("JetMoeConfig", {**_SMALL, "num_key_value_heads": 2, "kv_channels": 8, "intermediate_size": 48}),
    "llama4_text": (
        "Llama4TextConfig",
        {**_GQA, "intermediate_size_mlp": 48, "head_dim": 8, "num_local_experts": 2, "attention_chunk_size": None},
    ),
    "bitnet": ("BitNetConfig", _GQA),
    "nanochat": ("NanoChatConfig", _GQA),
    "diffllama": ("DiffLlamaConfig", _GQA),
    "dbrx": (
        "DbrxConfig",
        {
            "vocab_size": VOCAB,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "pad_token_id": 0,
            "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2},
        },
    ),
    "gemma3n": (
        "Gemma3nTextConfig",
        {
            **_GQA,
            "head_dim": 8,
            "num_kv_shared_layers": 0,
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": WINDOW,
        },
    ),
    "gpt_neo": (
        "GPTNeoConfig",
        {**_SMALL, "attention_types": [[["global", "local"], 1]], "window_size": WINDOW, "intermediate_size": 48},
    ),
    "rwkv": ("RwkvConfig", {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 48}),
    "gemma4": ("Gemma4TextConfig", _GEMMA4),
    "gemma4-noperlayer": ("Gemma4TextConfig", {**_GEMMA4, "hidden_size_per_layer_input": 0}),
    "minimax": (
        "MiniMaxConfig",
        {
            **_GQA,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "head_dim": 8,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "layer_types": ["full_attention", "linear_attention"],
            "block_size": 8,
        },
    ),
}
# recompute="memo" needs what these families do not give: the refusal names the true cause (Falcon, whose backbone
# passes its layers no keyword arguments and whose attention calls torch's SDPA itself, trains under memo too)
MEMO_REFUSALS = {
    "bloom": "BloomBlock adds a positional bias to its attention scores",
    "mpt": "MptBlock adds a positional bias to its attention scores",
    "doge": "DogeAttention hands its attention function a mask it builds itself",
    "minimax": "MiniMaxLightningAttention in MiniMaxDecoderLayer does not call transformers' attention interface",
    "gemma3n": "Gemma3nTextDecoderLayer gets arguments that need a gradient besides its hidden states .per_layer_input",
    "gpt_neo": "GPTNeoSelfAttention in GPTNeoBlock does not call .*it computes its attention in its own code",
    "rwkv": "RwkvBlock takes its hidden states as 'hidden', not as transformers' decoder layers do",
    "gemma4": "Gemma4TextDecoderLayer gets arguments that need a gradient besides its hidden states .per_layer_input",
}
MODES = ("none", "full", "selective", "memo")


@pytest.fixture(autouse=True)
def nothing_passed_before(monkeypatch):
    """Every test probes its models itself: no check passed earlier in this process is remembered."""
    monkeypatch.setattr(self_check, "_PASSED", {})


def _build(name: str) -> torch.nn.Module:
    config_class, fields = FAMILIES[name]
    config = getattr(transformers, config_class)(**fields)
    for field in config.to_dict():
        if "dropout" in field or "pdrop" in field:
            setattr(config, field, 0.0)
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # grouped_mm has no fp64 kernel on the CPU
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double().train()


def _batch(padded: bool) -> dict[str, torch.Tensor]:
    ids, labels = make_batch(2, SEQ)
    batch = {"input_ids": ids, "labels": labels}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, -7:] = 0
        labels[mask == 0] = -100
        batch["attention_mask"] = mask
    return batch


def _options(mode: str) -> dict:
    extra = {"offload_fraction": 0.5} if mode == "memo" else {}
    return {"recompute": mode, "mlp_chunks": 3, "lm_head_chunks": 2, **extra}


# every family padded; unpadded the families whose per-sample attention trained wrong (the check's fallback)
CASES = [(name, True) for name in FAMILIES] + [(name, False) for name in ("falcon", "falcon-new", "doge")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "padded"), CASES, ids=[f"{n}-{'padded' if p else 'plain'}" for n, p in CASES])
def test_family_trains_exactly_or_is_refused_with_the_cause(name, mode, padded):
    reference = _build(name)
    model = hf_memo.apply(copy.deepcopy(reference), **_options(mode))
    batch = _batch(padded)
    want = reference(**batch, use_cache=False)
    want.loss.backward()
    if mode == "memo" and name in MEMO_REFUSALS:
        with pytest.raises(ValueError, match=MEMO_REFUSALS[name]):
            model(**batch)
        assert all(p.grad is None for p in model.parameters())  # refused before any gradient
        return
    out = model(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-6, atol=0)
    assert _worst_gradient(model, reference) <= 1e-5  # fp32 inside some of them (routers, norms)
    assert patch_state(model).self_check.checked == {"padded" if padded else "plain"}


def _worst_gradient(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """The largest gradient difference relative to the largest element of the reference's gradient."""
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}: a gradient in only one model"
        if q.grad is not None:
            worst = max(worst, float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)))
    return worst


@pytest.mark.parametrize("name", ["falcon", "doge"])
def test_without_its_fallback_the_check_refuses_the_families_per_sample_attention_trains_wrong(name, monkeypatch):
    """hf_memo's per-sample attention loses Falcon's causal mask (Falcon branches on the implementation's name) and
    Doge's learned mask: with the fallback to transformers' masks switched off, the check refuses them at the first
    step, naming the model, the layer and the difference, before any gradient exists."""
    monkeypatch.setattr(self_check, "attends_per_sample", lambda model: False)
    model = hf_memo.apply(_build(name), recompute="none", mlp_chunks=3, lm_head_chunks=2)
    model_class = type(model).__name__
    with pytest.raises(self_check.SelfCheckError, match=f"cannot train {model_class} .*decoder layer 0 .*differing"):
        model(**_batch(False))
    assert all(p.grad is None for p in model.parameters())


def test_a_model_whose_unpatched_forward_fails_on_the_probe_is_refused_not_trained_unchecked(monkeypatch):
    """Nothing to compare with is no pass: the refusal names the model, the probe and the unpatched model's error."""
    original = self_check._run

    def reference_fails(*args):
        if args[-1] is not None:  # the unpatched pass draws the cotangents
            raise RuntimeError("the unpatched layer needs more positions")
        return original(*args)

    monkeypatch.setattr(self_check, "_run", reference_fails)
    model = hf_memo.apply(build_model("llama"), recompute="selective")
    expected = "cannot check LlamaForCausalLM .*unpatched model fails on the self-check's probe .*needs more positions"
    with pytest.raises(self_check.SelfCheckError, match=expected):
        model(**_batch(False))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("shape", "axis"), [((2, 5, 8), 0), ((4, 2, 5, 8), 1), ((2, 5), 0), ((5, 2, 8), None), ((2, 4, 8), None)]
)
def test_the_token_axes_of_a_layer_output_are_found_where_they_are(shape, axis):
    real = torch.ones(2, 5, dtype=torch.bool)
    real[1, 3:] = False
    y = torch.randn(shape)
    assert self_check._token_axis(y, real) == axis
    x, kept = self_check._real_rows(y, y, real)
    assert kept.shape == ((8,) + shape[:axis] + shape[axis + 2 :] if axis is not None else shape)
    if axis == 1:
        assert torch.equal(kept, y.movedim((1, 2), (0, 1))[real])


def test_without_the_check_falcon_would_train_wrong():
    """What the check guards against: Falcon with per-sample attention and no check trains with other gradients."""
    reference = _build("falcon")
    model = hf_memo.apply(copy.deepcopy(reference), recompute="none", self_check=False)
    batch = _batch(False)
    model(**batch).loss.backward()
    reference(**batch, use_cache=False).loss.backward()
    assert _worst_gradient(model, reference) > 0.01


def test_a_patch_that_changes_an_mlp_is_refused_naming_the_layer(monkeypatch):
    """A fault injected into the mini-sequence MLP of layer 1 only: the check names layer 1, and the MLP, which is
    exact run whole."""
    model = hf_memo.apply(build_model("llama"), recompute="full", mlp_chunks=3)
    layer = patch_state(model).structure.layers[1]
    installed = layer.mlp.forward  # hf_memo's forward: the fault is in the patched model only
    impl = installed.impl
    monkeypatch.setattr(installed, "impl", lambda *args: impl(*args) * 1.001)
    expected = r"its MLP \(LlamaMLP\) run in mini-sequences differs .*decoder layer 1 \(LlamaDecoderLayer\)'s output"
    with pytest.raises(self_check.SelfCheckError, match=expected):
        model(**_batch(False))


def test_the_check_runs_once_per_kind_of_batch_and_once_per_configuration(monkeypatch):
    calls = []
    original = self_check._run
    monkeypatch.setattr(self_check, "_run", lambda *a: calls.append(1) or original(*a))
    model = hf_memo.apply(build_model("llama"), recompute="memo", offload_fraction=0.5)
    for padded in (True, True, False):
        model(**_batch(padded)).loss.backward()
    assert len(calls) == 4  # the unpatched and the patched pass, on the first padded and the first plain step
    assert patch_state(model).self_check.report["worst"] < 1e-10
    again = hf_memo.apply(build_model("llama", seed=1), recompute="memo", offload_fraction=0.5)
    again(**_batch(True)).loss.backward()
    assert len(calls) == 4 and patch_state(again).self_check.checked == {"padded"}  # remembered: the same code paths
    other = hf_memo.apply(build_model("llama"), recompute="memo", offload_fraction=0.25)
    other(**_batch(True)).loss.backward()
    assert len(calls) == 6


def test_a_model_whose_per_sample_attention_was_dropped_drops_it_again_without_a_probe(monkeypatch):
    first = hf_memo.apply(_build("falcon"), recompute="full")
    first(**_batch(False)).loss.backward()
    assert not attends_per_sample(first)
    monkeypatch.setattr(self_check, "_run", lambda *a: pytest.fail("probed again"))
    second = hf_memo.apply(_build("falcon"), recompute="full")
    assert attends_per_sample(second)
    second(**_batch(False)).loss.backward()
    assert not attends_per_sample(second)


@pytest.mark.parametrize(
    ("arguments", "kind"),
    [
        ({}, "plain"),
        ({"attention_mask": torch.ones(2, 5)}, "plain"),
        ({"attention_mask": torch.tensor([[1, 1, 0]])}, "padded"),
        ({"position_ids": torch.tensor([[0, 1, 2, 3]])}, "plain"),
        ({"position_ids": torch.tensor([[0, 1, 0, 1]])}, "packed"),
    ],
)
def test_batch_kind(arguments, kind):
    assert self_check.batch_kind(arguments) == kind


def test_switched_off_it_never_runs(monkeypatch):
    monkeypatch.setattr(self_check, "_run", lambda *a: pytest.fail("the check ran"))
    model = hf_memo.apply(build_model("llama"), self_check=False)
    model(**_batch(False)).loss.backward()


def test_probe_takes_rows_with_real_tokens_and_cuts_every_per_token_input():
    ids, labels = make_batch(3, 40)
    mask = torch.ones_like(ids)
    mask[0, :35] = 0  # left padding past the probe's positions: no real token there
    positions = torch.arange(40).repeat(3, 1)
    probe = self_check.probe_inputs({"input_ids": ids, "attention_mask": mask, "position_ids": positions}, {}, labels)
    tokens = self_check.PROBE_TOKENS
    assert torch.equal(probe["input_ids"], ids[1:, :tokens]) and torch.equal(probe["labels"], labels[1:, :tokens])
    assert probe["position_ids"].shape == (2, tokens) and probe["use_cache"] is False
    only_padding = self_check.probe_inputs({"input_ids": ids[:1], "attention_mask": mask[:1]}, {}, labels[:1])
    assert only_padding is None


def test_check_runs_on_demand_and_reports(caplog):
    model = hf_memo.apply(build_model("llama"), recompute="selective")
    with caplog.at_level(logging.INFO, logger="hf_memo.patches.self_check"):
        report = hf_memo.check(model, **_batch(True))
    assert report["worst"] < 1e-10 and report["seconds"] > 0
    assert "self-check passed for LlamaForCausalLM" in caplog.text
    with pytest.raises(ValueError, match="needs a model patched"):
        hf_memo.check(build_model("llama"), **_batch(False))


def test_a_gradient_that_is_zero_but_for_rounding_is_not_taken_for_a_difference():
    """A top-1 router whose weight is normalised to one gets a gradient of ~1e-20 (the rounding of terms that
    cancel): it is measured against the probe's largest gradient, not against itself."""
    config_class, fields = FAMILIES["dbrx"]
    config = getattr(transformers, config_class)(**fields)
    config.ffn_config.moe_num_experts, config.ffn_config.moe_top_k = 2, 1
    torch.manual_seed(0)
    model = hf_memo.apply(transformers.AutoModelForCausalLM.from_config(config).double(), recompute="none")
    report = hf_memo.check(model, **_batch(True))
    assert report["worst"] < 1e-10


def test_an_mlp_that_mixes_the_tokens_of_the_sequence_is_refused_naming_it():
    """Doge's mixture of experts routes with scores over the whole batch: no mini-sequence of it can be exact, and the
    check finds that the model is exact with each MLP run whole."""
    config = transformers.DogeConfig(**_GQA, is_moe=True, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = hf_memo.apply(
        transformers.AutoModelForCausalLM.from_config(config).double(), recompute="none", mlp_chunks=3
    )
    with pytest.raises(
        self_check.SelfCheckError,
        match=r"its MLP \(DogeCDMoE\) run in mini-sequences .*mixes the tokens of the sequence",
    ):
        model(**_batch(False))


@pytest.mark.parametrize("mode", ["none", "memo"])
@pytest.mark.parametrize("name", CATALOG_NAMES)
def test_every_catalog_model_passes_its_own_check(name, mode):
    """No false refusal over the catalog (windows, soft-capping, sinks, MoE with the router loss, fp32 norms and
    softmax): the check passes on a padded batch, and its worst difference is rounding."""
    model = hf_memo.apply(build_catalog_model(name), **_options(mode))
    ids, labels = make_batch(2, SEQ)
    mask = torch.ones_like(ids)
    mask[1, SEQ - (WINDOW - 3) :] = 0  # fewer than a window of right padding (see the catalog's fp32 softmax)
    labels[mask == 0] = -100
    report = hf_memo.check(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert report["worst"] <= FP32_TOLERANCE


def test_an_mlp_that_samples_in_training_is_refused_before_any_gradient():
    """PhiMoE's router samples its experts in training (several random draws per call): the eval-mode probe cannot
    see it, mini-sequences would draw in another order, so the check counts the MLP's draws in training mode."""
    config = transformers.PhimoeConfig(**_GQA, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = hf_memo.apply(transformers.AutoModelForCausalLM.from_config(config).double().train(), recompute="none")
    with pytest.raises(self_check.SelfCheckError, match=r"its MLP \(PhimoeSparseMoeBlock\) draws random numbers"):
        model(**_batch(True))
    assert all(p.grad is None for p in model.parameters())


def test_an_mlp_with_one_dropout_per_call_trains():
    """One draw per call (GPT-2's MLP dropout) keeps its order in mini-sequences: not refused."""
    model = hf_memo.apply(build_model("gpt2", resid_pdrop=0.1).train(), recompute="none", mlp_chunks=3)
    model(**_batch(True)).loss.backward()
    assert patch_state(model).self_check.checked == {"padded"}
