"""Qwen3: Llama layout with per-head RMSNorm on queries and keys."""

from __future__ import annotations

from typing import Any

from transformers.models.qwen3 import modeling_qwen3 as hf

from hf_memo.config import MemoConfig
from hf_memo.patches.classes import install_on_class
from hf_memo.patches.family import Family
from hf_memo.patches.llama import llama_layout_split

FAMILY = Family(
    model_type="qwen3",
    causal_lm=hf.Qwen3ForCausalLM,
    decoder_layer=hf.Qwen3DecoderLayer,
    mlp=hf.Qwen3MLP,
    split=llama_layout_split(hf.apply_rotary_pos_emb),
)


def apply_hf_memo_to_qwen3(config: MemoConfig | None = None, **overrides: Any) -> None:
    """Patch every ``Qwen3ForCausalLM`` built from now on (call before ``from_pretrained``)."""
    install_on_class(FAMILY, config, **overrides)
