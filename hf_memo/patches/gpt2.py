"""GPT-2: fused q/k/v ``Conv1D``, learned positions, LayerNorm, GELU MLP, LM head tied to the embeddings."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
from transformers.models.gpt2 import modeling_gpt2 as hf

from hf_memo.config import MemoConfig
from hf_memo.patches.classes import install_on_class
from hf_memo.patches.family import Family
from hf_memo.runtime.executor import project_rows


def _intermediate_size(config: PretrainedConfig) -> int:
    return config.n_inner if config.n_inner is not None else 4 * config.hidden_size


class GPT2Split:
    """A GPT-2 block cut around attention.

    ``project``: ``ln_1`` and the fused ``c_attn``: ``(B, s, H) -> q, k, v (B, h, s, D)`` (positions were
    added to the embeddings). ``finish``: ``c_proj`` with residual dropout, residual, ``ln_2``, MLP,
    residual: ``(B, s, H), (B, s, h*D) -> (B, s, H)``. ``dropout_p``: ``attn_pdrop`` in training (the
    attention core applies it), else 0.
    """

    def __init__(self, block: nn.Module, position_embeddings: Any = None) -> None:
        self.block, self.attn = block, block.attn
        self.scale = self.attn.scaling
        self.dropout_p = self.attn.attn_dropout.p if self.attn.training else 0.0

    def project(self, x: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.attn.c_attn(self.block.ln_1(x)).split(self.attn.split_size, dim=2)
        shape = (*q.shape[:-1], -1, self.attn.head_dim)
        return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        h = self.attn.resid_dropout(project_rows(self.attn.c_proj, o)) + x
        return h + self.block.mlp(self.block.ln_2(h))

    def kept(self) -> list[torch.Tensor]:
        return [*self.block.parameters(), *self.block.buffers()]


FAMILY = Family(
    model_type="gpt2",
    causal_lm=hf.GPT2LMHeadModel,
    decoder_layer=hf.GPT2Block,
    mlp=hf.GPT2MLP,
    split=GPT2Split,
    sliding_window=lambda block: None,
    final_norm="ln_f",
    intermediate_size=_intermediate_size,
    output_class=CausalLMOutputWithCrossAttentions,
)


def apply_hf_memo_to_gpt2(config: MemoConfig | None = None, **overrides: Any) -> None:
    """Patch every ``GPT2LMHeadModel`` built from now on (call before ``from_pretrained``)."""
    install_on_class(FAMILY, config, **overrides)
