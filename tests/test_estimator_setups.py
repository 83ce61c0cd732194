"""The training setups' shared parts: what ``trainable="lora"`` trains, and the dtypes by name."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hf_memo.estimator.setups import Lora, dtype_name, torch_dtype, with_lora
from hf_memo.profiler.fake_model import fake_causal_lm
from tests.test_profiler_step import CONFIGS

# The LongAlpaca recipe's LoRA (examples/longalpaca/train.py): adapters on the attention projections, the
# embeddings and the norms trained in full.
RECIPE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RECIPE_MODULES = ("embed_tokens", "norm")


def real_trainable(config, **lora) -> int:
    """Trainable elements of a real (not fake) model under PEFT LoRA configured with ``lora``."""
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(task_type="CAUSAL_LM", **lora))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "lora,peft_settings",
    [
        (Lora(), {"r": 8}),
        (
            Lora(16, RECIPE_TARGETS, RECIPE_MODULES),
            {"r": 16, "target_modules": list(RECIPE_TARGETS), "modules_to_save": list(RECIPE_MODULES)},
        ),
    ],
)
def test_the_profiled_model_trains_what_peft_trains_on_a_real_model(lora, peft_settings):
    config = CONFIGS["llama"](2)
    fake, session = fake_causal_lm(config, torch.bfloat16)
    adapted = with_lora(fake, session, lora)
    trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert trained == real_trainable(config, **peft_settings)
    if lora.modules:  # rank 16 on q, k, v, o of 2 layers (H 64, K/V width 32); embeddings (500 x 64); 5 norms
        assert trained == 2 * 16 * (2 * (64 + 64) + 2 * (64 + 32)) + 500 * 64 + 5 * 64


def test_default_targets_are_pefts_for_the_model_type_and_the_setup_says_what_it_trains():
    assert Lora().resolved("llama").targets == ("q_proj", "v_proj")
    assert Lora(4, ("c_attn",)).resolved("llama").targets == ("c_attn",)
    assert Lora().describe() == "LoRA r=8 on PEFT's default targets"
    assert Lora(16, RECIPE_TARGETS, RECIPE_MODULES).describe() == (
        "LoRA r=16 on q_proj, k_proj, v_proj, o_proj; embed_tokens, norm trained in full"
    )


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"rank": 0}, "lora_rank must be an int >= 1, got 0"),
        ({"targets": ()}, "lora_targets must name at least one module"),
        ({"modules": ("",)}, "trainable_modules must be module names"),
    ],
)
def test_bad_lora_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Lora(**settings)


def test_names_that_match_no_module_are_refused_not_ignored():
    fake, session = fake_causal_lm(CONFIGS["llama"](2), torch.bfloat16)
    with pytest.raises(ValueError, match="trainable_modules embed: no module of LlamaForCausalLM has such a name"):
        with_lora(fake, session, Lora(targets=("q_proj",), modules=("norm", "embed")))
    fake, session = fake_causal_lm(CONFIGS["llama"](2), torch.bfloat16)
    with pytest.raises(ValueError, match="PEFT cannot add LoRA to LlamaForCausalLM: .*qproj"):
        with_lora(fake, session, Lora(targets=("qproj",)))


def test_dtypes_are_named_and_pytorch_dtypes_are_taken_as_they_are():
    """The estimator names dtypes (so that a cached answer needs no PyTorch) and converts a name only to profile."""
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype(torch.float64) is torch.float64
    assert dtype_name(torch.float16) == "fp16" and dtype_name("fp32") == "fp32"
    assert dtype_name(torch.float64) == "torch.float64"  # no name: told as PyTorch tells it
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp16, fp32, got 'float32'"):
        torch_dtype("float32")
