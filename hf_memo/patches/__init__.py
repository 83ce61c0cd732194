"""Patching causal LMs: found by structure (:mod:`.structure`), installed per instance or per class."""

from hf_memo.patches.apply import applied_config, apply, causal_lm_of, check, memo_runtime, revert
from hf_memo.patches.classes import (
    apply_hf_memo_to_gpt2,
    apply_hf_memo_to_llama,
    apply_hf_memo_to_mistral,
    apply_hf_memo_to_qwen2,
    apply_hf_memo_to_qwen3,
    install_on_class,
    uninstall_from_class,
)
from hf_memo.patches.registry import TESTED_MODEL_TYPES, supported_model_types

__all__ = [
    "TESTED_MODEL_TYPES",
    "applied_config",
    "apply",
    "apply_hf_memo_to_gpt2",
    "apply_hf_memo_to_llama",
    "apply_hf_memo_to_mistral",
    "apply_hf_memo_to_qwen2",
    "apply_hf_memo_to_qwen3",
    "causal_lm_of",
    "check",
    "install_on_class",
    "memo_runtime",
    "revert",
    "supported_model_types",
    "uninstall_from_class",
]
