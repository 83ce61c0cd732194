"""Llama: gated SiLU MLP (gate/up/down), RMSNorm, RoPE, grouped-query attention.

Mistral, Qwen2 and Qwen3 share this layout and reuse :class:`LlamaLayoutSplit`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.models.llama import modeling_llama as hf

from hf_memo.config import MemoConfig
from hf_memo.patches.classes import install_on_class
from hf_memo.patches.family import Family
from hf_memo.runtime.executor import project_rows

Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LlamaLayoutSplit:
    """A Llama-layout decoder layer cut around attention.

    ``project``: input norm, q/k/v projections, optional per-head q/k norms (Qwen3), RoPE with the
    rows' positions: ``(B, s, H) -> q (B, h, s, D), k, v (B, h_kv, s, D)``. ``finish``: o_proj,
    residual, post-attention norm, MLP, residual: ``(B, s, H), (B, s, h*D) -> (B, s, H)``. ``dropout_p``:
    the config's ``attention_dropout`` in training (the attention core applies it), else 0.
    """

    def __init__(self, layer: nn.Module, position_embeddings: tuple[torch.Tensor, torch.Tensor], rope: Rope) -> None:
        self.layer, self.attn, self.rope = layer, layer.self_attn, rope
        self.cos, self.sin = position_embeddings
        self.scale = self.attn.scaling
        self.dropout_p = self.attn.attention_dropout if self.attn.training else 0.0

    def project(self, x: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self.attn
        h = self.layer.input_layernorm(x)
        shape = (*h.shape[:-1], -1, attn.head_dim)
        q, k, v = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rope(q, k, self.cos[:, start:stop], self.sin[:, start:stop])
        return q, k, v

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        h = x + project_rows(self.attn.o_proj, o)
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def kept(self) -> list[torch.Tensor]:
        return [*self.layer.parameters(), *self.layer.buffers(), self.cos, self.sin]


def llama_layout_split(rope: Rope) -> Callable[[nn.Module, Any], LlamaLayoutSplit]:
    """The family ``split`` for a Llama-layout model whose modeling module defines ``rope``."""
    return lambda layer, position_embeddings: LlamaLayoutSplit(layer, position_embeddings, rope)


FAMILY = Family(
    model_type="llama",
    causal_lm=hf.LlamaForCausalLM,
    decoder_layer=hf.LlamaDecoderLayer,
    mlp=hf.LlamaMLP,
    split=llama_layout_split(hf.apply_rotary_pos_emb),
)


def apply_hf_memo_to_llama(config: MemoConfig | None = None, **overrides: Any) -> None:
    """Patch every ``LlamaForCausalLM`` built from now on (call before ``from_pretrained``)."""
    install_on_class(FAMILY, config, **overrides)
