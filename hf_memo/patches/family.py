"""`Family`: what hf_memo needs to know about one model family to patch it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput


def _intermediate_size(config: PretrainedConfig) -> int:
    return config.intermediate_size


@dataclass(frozen=True)
class Family:
    """One model family (a ``config.model_type``) and where its parts live.

    Attributes:
        model_type: the ``config.model_type`` this family handles.
        causal_lm: the ``*ForCausalLM`` class hf_memo patches.
        decoder_layer: the decoder layer class.
        mlp: the MLP class; each instance gets the mini-sequence forward.
        intermediate_size: the MLP's hidden width ``I`` from the model config.
        output_class: the output type of ``causal_lm.forward``.
    """

    model_type: str
    causal_lm: type[PreTrainedModel]
    decoder_layer: type[nn.Module]
    mlp: type[nn.Module]
    intermediate_size: Callable[[PretrainedConfig], int] = _intermediate_size
    output_class: type[ModelOutput] = CausalLMOutputWithPast
