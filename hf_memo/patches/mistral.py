"""Mistral: Llama layout with sliding-window attention."""

from __future__ import annotations

from typing import Any

from transformers.models.mistral import modeling_mistral as hf

from hf_memo.config import MemoConfig
from hf_memo.patches.classes import install_on_class
from hf_memo.patches.family import Family
from hf_memo.patches.llama import llama_layout_split

FAMILY = Family(
    model_type="mistral",
    causal_lm=hf.MistralForCausalLM,
    decoder_layer=hf.MistralDecoderLayer,
    mlp=hf.MistralMLP,
    split=llama_layout_split(hf.apply_rotary_pos_emb),
    sliding_window=lambda layer: layer.self_attn.config.sliding_window,
)


def apply_hf_memo_to_mistral(config: MemoConfig | None = None, **overrides: Any) -> None:
    """Patch every ``MistralForCausalLM`` built from now on (call before ``from_pretrained``)."""
    install_on_class(FAMILY, config, **overrides)
