import pytest

from hf_memo.patches.registry import FAMILIES, family_for, supported_model_types


def test_registry_covers_the_five_families():
    assert supported_model_types() == ["gpt2", "llama", "mistral", "qwen2", "qwen3"]
    for model_type, family in FAMILIES.items():
        assert family.model_type == model_type
        assert family.causal_lm.__name__.endswith(("ForCausalLM", "LMHeadModel"))


def test_unknown_model_type_lists_supported_types():
    with pytest.raises(ValueError) as excinfo:
        family_for("bert")
    assert str(excinfo.value) == (
        "hf_memo does not support model_type 'bert'; supported model types: gpt2, llama, mistral, qwen2, qwen3"
    )
