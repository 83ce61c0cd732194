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


# Model types outside the catalog that tests/test_patches_self_check.py proves exact in the modes named (and refused
# with the cause in the others): layers that take other paths than the catalog's (see that test's FAMILIES).
_EVERY_MODE = ("none", "full", "selective", "memo")
_BUT_MEMO = ("none", "full", "selective")
TESTED_OUTSIDE_CATALOG = {
    "bitnet": _EVERY_MODE,
    "bloom": _BUT_MEMO,
    "dbrx": _EVERY_MODE,
    "diffllama": _EVERY_MODE,
    "doge": _BUT_MEMO,
    "falcon": _EVERY_MODE,
    "gemma3n_text": _BUT_MEMO,  # without KV sharing, which is refused in every mode
    "gemma4_text": _BUT_MEMO,  # memo too without per-layer inputs (their gradient memo refuses to drop)
    "gpt_neo": _BUT_MEMO,
    "gpt_neox": _EVERY_MODE,
    "jetmoe": _EVERY_MODE,
    "llama4_text": _EVERY_MODE,
    "minimax": _BUT_MEMO,
    "mpt": _BUT_MEMO,
    "nanochat": _EVERY_MODE,
    "nemotron": _EVERY_MODE,
    "olmo": _EVERY_MODE,
    "rwkv": _BUT_MEMO,
    "stablelm": _EVERY_MODE,
}


def supported_model_types(recompute: str | None = None) -> list[str]:
    """The ``config.model_type`` values the test suite proves exact in every mode, or (``recompute`` given) in that
    mode. Others are patched when their structure is recognised, and every model checks itself on its first training
    step (:mod:`hf_memo.patches.self_check`) or is refused with the reason."""
    outside = [
        t for t, modes in TESTED_OUTSIDE_CATALOG.items() if (recompute in modes if recompute else modes == _EVERY_MODE)
    ]
    return sorted({*TESTED_MODEL_TYPES, *outside})
