"""Qwen2: Llama layout with q/k/v projection biases."""

from __future__ import annotations

from typing import Any

from transformers.models.qwen2 import modeling_qwen2 as hf

from hf_memo.config import MemoConfig
from hf_memo.patches.classes import install_on_class
from hf_memo.patches.family import Family
from hf_memo.patches.llama import llama_layout_split

FAMILY = Family(
    model_type="qwen2",
    causal_lm=hf.Qwen2ForCausalLM,
    decoder_layer=hf.Qwen2DecoderLayer,
    mlp=hf.Qwen2MLP,
    split=llama_layout_split(hf.apply_rotary_pos_emb),
)


def apply_hf_memo_to_qwen2(config: MemoConfig | None = None, **overrides: Any) -> None:
    """Patch every ``Qwen2ForCausalLM`` built from now on (call before ``from_pretrained``)."""
    install_on_class(FAMILY, config, **overrides)
