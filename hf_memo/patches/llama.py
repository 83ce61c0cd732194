"""Llama: gated SiLU MLP (gate/up/down), RMSNorm, RoPE, grouped-query attention."""

from __future__ import annotations

from typing import Any

from transformers.models.llama import modeling_llama as hf

from hf_memo.config import MemoConfig
from hf_memo.patches.classes import install_on_class
from hf_memo.patches.family import Family

FAMILY = Family(
    model_type="llama",
    causal_lm=hf.LlamaForCausalLM,
    decoder_layer=hf.LlamaDecoderLayer,
    mlp=hf.LlamaMLP,
)


def apply_hf_memo_to_llama(config: MemoConfig | None = None, **overrides: Any) -> None:
    """Patch every ``LlamaForCausalLM`` built from now on (call before ``from_pretrained``)."""
    install_on_class(FAMILY, config, **overrides)
