"""The model types hf_memo's tests prove exact, against the unpatched model, in every mode.

hf_memo patches any decoder-only causal LM whose structure it recognises (:mod:`hf_memo.patches.structure`);
this list is what the test suite builds and compares, family by family, and what the README's table shows.
"""

from __future__ import annotations

TESTED_MODEL_TYPES = (
    "cohere",
    "cohere2",
    "exaone4",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "glm4",
    "gpt2",
    "gpt_oss",
    "granite",
    "llama",
    "ministral",
    "mistral",
    "mixtral",
    "olmo2",
    "olmo3",
    "olmoe",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "smollm3",
    "starcoder2",
)


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values the test suite proves exact (others are patched when their structure is
    recognised and their layers pass the split's check, or refused with the reason)."""
    return sorted(TESTED_MODEL_TYPES)
