"""Model-family patches: a registry keyed by ``config.model_type`` and one installer per family."""

from hf_memo.patches.apply import applied_config, apply, causal_lm_of, memo_runtime, revert
from hf_memo.patches.classes import uninstall_from_class
from hf_memo.patches.gpt2 import apply_hf_memo_to_gpt2
from hf_memo.patches.llama import apply_hf_memo_to_llama
from hf_memo.patches.mistral import apply_hf_memo_to_mistral
from hf_memo.patches.qwen2 import apply_hf_memo_to_qwen2
from hf_memo.patches.qwen3 import apply_hf_memo_to_qwen3
from hf_memo.patches.registry import FAMILIES, family_for, supported_model_types

__all__ = [
    "FAMILIES",
    "applied_config",
    "apply",
    "apply_hf_memo_to_gpt2",
    "apply_hf_memo_to_llama",
    "apply_hf_memo_to_mistral",
    "apply_hf_memo_to_qwen2",
    "apply_hf_memo_to_qwen3",
    "causal_lm_of",
    "family_for",
    "memo_runtime",
    "revert",
    "supported_model_types",
    "uninstall_from_class",
]
