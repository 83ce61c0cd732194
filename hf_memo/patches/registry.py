"""The supported model families, keyed by ``config.model_type``."""

from __future__ import annotations

from hf_memo.patches import gpt2, llama, mistral, qwen2, qwen3
from hf_memo.patches.family import Family

FAMILIES: dict[str, Family] = {
    module.FAMILY.model_type: module.FAMILY for module in (llama, mistral, qwen2, qwen3, gpt2)
}


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values hf_memo can patch, sorted."""
    return sorted(FAMILIES)


def family_for(model_type: str) -> Family:
    """The family for ``model_type``; ``ValueError`` listing the supported types otherwise."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"hf_memo does not support model_type {model_type!r}; supported model types: "
            + ", ".join(supported_model_types())
        ) from None
