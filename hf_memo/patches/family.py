"""`Family`: what hf_memo needs to know about one model family to patch it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput


def _intermediate_size(config: PretrainedConfig) -> int:
    return config.intermediate_size


def _no_window(layer: nn.Module) -> int | None:
    return getattr(layer.self_attn, "sliding_window", None)


@dataclass(frozen=True)
class Family:
    """One model family (a ``config.model_type``) and where its parts live.

    Attributes:
        model_type: the ``config.model_type`` this family handles.
        causal_lm: the ``*ForCausalLM`` class hf_memo patches.
        decoder_layer: the decoder layer class.
        mlp: the MLP class; each instance gets the mini-sequence forward.
        intermediate_size: the MLP's hidden width ``I`` from the model config.
        split: ``split(layer, position_embeddings)`` cuts a decoder layer around its attention core
            for the memo executor (a :class:`hf_memo.runtime.executor.LayerSplit`).
        sliding_window: the attention window of a decoder layer, or ``None`` for full causal attention.
        final_norm: the attribute of the backbone holding the norm applied after the last layer.
        output_class: the output type of ``causal_lm.forward``.
    """

    model_type: str
    causal_lm: type[PreTrainedModel]
    decoder_layer: type[nn.Module]
    mlp: type[nn.Module]
    split: Callable[[nn.Module, Any], Any]
    intermediate_size: Callable[[PretrainedConfig], int] = _intermediate_size
    sliding_window: Callable[[nn.Module], int | None] = _no_window
    final_norm: str = "norm"
    output_class: type[ModelOutput] = CausalLMOutputWithPast
