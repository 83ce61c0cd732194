"""The logit transforms read from a model's traits, and the check against its own forward that refuses others."""

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaForCausalLM,
)

import hf_memo
from hf_memo.patches.head_transform import LogitTransform, confirmed_logit_transform, logit_transform
from tests.conftest import TINY_LAYOUT, build_model


@pytest.mark.parametrize(
    ("model", "transform"),
    [
        (lambda: GraniteForCausalLM(GraniteConfig(**TINY_LAYOUT, logits_scaling=4.0)), LogitTransform(divide=4.0)),
        (lambda: CohereForCausalLM(CohereConfig(**TINY_LAYOUT, logit_scale=0.5)), LogitTransform(multiply=0.5)),
        (
            lambda: Gemma2ForCausalLM(Gemma2Config(**TINY_LAYOUT, final_logit_softcapping=3.0)),
            LogitTransform(softcap=3.0),
        ),
        (lambda: build_model("llama"), LogitTransform()),
    ],
)
def test_the_transform_is_read_from_the_traits_and_confirmed_by_the_models_own_logits(model, transform):
    model = model().double()
    assert logit_transform(model) == transform
    assert confirmed_logit_transform(model) == transform


class _IgnoresItsSoftcap(Gemma2ForCausalLM):
    """A causal LM whose config names a final soft-cap its forward does not apply (as Gemma 3's multimodal class)."""

    def forward(self, *args, **kwargs):
        cap, self.config.final_logit_softcapping = self.config.final_logit_softcapping, None
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.config.final_logit_softcapping = cap


def test_a_trait_the_forward_ignores_is_not_applied():
    model = _IgnoresItsSoftcap(Gemma2Config(**TINY_LAYOUT, final_logit_softcapping=3.0)).double()
    assert logit_transform(model) == LogitTransform(softcap=3.0)
    assert confirmed_logit_transform(model) == LogitTransform()


class _DoubledLogits(LlamaForCausalLM):
    """A causal LM that transforms its logits in a way no trait describes."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 2 * out.logits
        return out


def test_a_model_with_an_unknown_logit_transform_is_refused_by_apply():
    model = _DoubledLogits(build_model("llama").config).double()
    with pytest.raises(ValueError, match="_DoubledLogits .*not its head's output with the transforms hf_memo knows"):
        hf_memo.apply(model)
    assert hf_memo.applied_config(model) is None


class _LossPlusAHalf(LlamaForCausalLM):
    """A causal LM whose loss is not the cross-entropy of its logits alone."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 0.5
        return out


def test_a_model_whose_loss_is_another_than_the_causal_lm_loss_of_its_logits_is_refused_by_apply():
    model = _LossPlusAHalf(build_model("llama").config).double()
    with pytest.raises(ValueError, match="_LossPlusAHalf .*its loss is not transformers' causal-LM loss") as refused:
        hf_memo.apply(model)
    assert "unshifted" not in str(refused.value)
    assert hf_memo.applied_config(model) is None


def test_cpm_ant_whose_loss_does_not_shift_the_labels_is_refused_with_that_cause():
    from transformers import CpmAntConfig, CpmAntForCausalLM

    config = CpmAntConfig(
        vocab_size=101, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=48, num_hidden_layers=2
    )
    model = CpmAntForCausalLM(config).double()
    with pytest.raises(ValueError, match="CpmAntForCausalLM .*each position against its own label, unshifted"):
        hf_memo.apply(model)


def test_the_check_leaves_the_rng_and_training_modes_as_they_were():
    model = build_model("llama")
    model.model.layers[0].eval()
    state = torch.get_rng_state()
    confirmed_logit_transform(model)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and not model.model.layers[0].training
