from hf_memo.patches.registry import TESTED_MODEL_TYPES, supported_model_types


def test_the_tested_model_types_are_listed_sorted_and_include_the_first_five():
    assert supported_model_types() == sorted(TESTED_MODEL_TYPES)
    assert {"gpt2", "llama", "mistral", "qwen2", "qwen3"} <= set(TESTED_MODEL_TYPES)
