"""GPT-2: fused q/k/v ``Conv1D``, learned positions, LayerNorm, GELU MLP, LM head tied to the embeddings."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
from transformers.models.gpt2 import modeling_gpt2 as hf

from hf_memo.config import MemoConfig
from hf_memo.patches.classes import install_on_class
from hf_memo.patches.family import Family


def _intermediate_size(config: PretrainedConfig) -> int:
    return config.n_inner if config.n_inner is not None else 4 * config.hidden_size


FAMILY = Family(
    model_type="gpt2",
    causal_lm=hf.GPT2LMHeadModel,
    decoder_layer=hf.GPT2Block,
    mlp=hf.GPT2MLP,
    intermediate_size=_intermediate_size,
    output_class=CausalLMOutputWithCrossAttentions,
)


def apply_hf_memo_to_gpt2(config: MemoConfig | None = None, **overrides: Any) -> None:
    """Patch every ``GPT2LMHeadModel`` built from now on (call before ``from_pretrained``)."""
    install_on_class(FAMILY, config, **overrides)
