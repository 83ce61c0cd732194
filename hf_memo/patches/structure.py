"""A causal LM's structure, found on the live model: backbone, decoder layers, their MLPs, final norm, head.

hf_memo patches any decoder-only model whose parts it can find this way and whose layers its split can
verify (:mod:`hf_memo.patches.layer_split`); nothing is keyed by class objects imported in advance, so a
model built from a reloaded modeling module (IPython's autoreload) is recognised like any other. What
cannot be patched exactly is refused by :func:`describe` with the model and what blocks it.
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput

from hf_memo.patches.backbone import backbone_of
from hf_memo.patches.head_transform import LogitTransform, confirmed_logit_transform

MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
ATTENTION_NAMES = ("self_attn", "attn", "self_attention")
_ATTENTION_CLASS = re.compile(r"(?<!Cross)Attention$|(?<!Cross)Attention[A-Z0-9]")
_MLP_CLASS = re.compile(r"MLP|FFN|FeedForward|Moe|MoE|Experts", re.IGNORECASE)
_NORM_CLASS = re.compile(r"Norm")
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_norm")
# Model types whose attention hf_memo cannot compute exactly, with what blocks them.
_REFUSED_CONFIG_TRAITS = {
    "attention_chunk_size": "chunked attention (each token attends only within its chunk of the sequence)",
    "num_kv_shared_layers": "layers that reuse other layers' keys and values (KV sharing)",
    "index_topk": "sparse attention (a learned indexer picks the keys each query attends)",
}


@dataclass
class Structure:
    """Where hf_memo finds the parts of one causal LM.

    Attributes:
        model_type: ``config.model_type`` (for messages).
        backbone: :func:`backbone_of` the model, the module the causal LM calls with the inputs.
        layers: the decoder layers, bottom to top.
        mlps: each layer's MLP (dense or mixture of experts), where the mini-sequence MLP is installed.
        final_norm: the name of the norm after the last layer (the loss runs it per mini-sequence), looked up when
            used: PEFT's ``modules_to_save`` may wrap it after patching, as it wraps the head.
        logits: the transform from the head's output to the model's logits (soft-capping, scales).
        output_class: the output type of the causal LM's forward.
        mlp_width: the widest per-token intermediate of an MLP ``I`` (sizes mini-sequence chunks).
        layout: the batch description of the training forward under way (see below).
    """

    model_type: str
    backbone: nn.Module
    layers: list[nn.Module]
    mlps: list[nn.Module]
    final_norm: str
    logits: LogitTransform
    output_class: type[ModelOutput]
    mlp_width: int
    anatomies: dict[int, Any] = field(default_factory=dict)  # per layer index, found at its first memo step
    selective_saves: dict[int, frozenset] = field(default_factory=dict)  # per layer index, at its first selective step
    # the batch description (a BatchLayout) of the backbone call under way, for layers their backbone does not
    # pass its keyword arguments to (Falcon, Bloom, MPT); None outside a described training forward
    layout: Any = None


def refuse(model: nn.Module, reason: str) -> ValueError:
    """The error for a model hf_memo cannot patch: the model, its type and what blocks it."""
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    return ValueError(f"hf_memo cannot patch {type(model).__name__} (model_type {model_type!r}): {reason}")


def mlp_width(config: PretrainedConfig) -> int:
    """The widest per-token MLP intermediate ``I`` of a model with text config ``config``.

    A dense MLP's ``intermediate_size`` (GPT-2: ``n_inner`` or ``4 * hidden``; the widest where it is given per
    layer, as Gemma-3n's); a token through a mixture of experts fills ``top_k`` experts' intermediates plus the
    shared expert's.
    """
    hidden = config.hidden_size
    dense = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    if isinstance(dense, (list, tuple)):
        dense = max(dense)
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None)
    expert = getattr(config, "moe_intermediate_size", None) or getattr(config, "expert_intermediate_size", None)
    if top_k and not expert and _num_experts(config):
        expert = dense
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    return max(dense, (top_k or 0) * (expert or 0) + shared)


def _num_experts(config: PretrainedConfig) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, name, None)
        if value:
            return value
    return 0


def _layer_list(model: PreTrainedModel) -> tuple[str, nn.Module, nn.ModuleList]:
    """``(parent's name, parent, layers)``: the module list of decoder layers (``num_hidden_layers`` of them, each
    with an MLP child) and the module holding it."""
    count = model.config.get_text_config().num_hidden_layers
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    root = decoder if isinstance(decoder, nn.Module) else model  # not a vision tower's encoder of the same depth
    names = {id(module): name for name, module in model.named_modules()}
    for parent in root.modules():
        prefix = names[id(parent)]
        for child in parent.children():
            is_list = isinstance(child, nn.ModuleList) and len(child) == count > 0
            if is_list and all(mlp_of(layer) is not None for layer in child):
                return prefix, parent, child
    raise refuse(model, f"found no list of {count} decoder layers each with an MLP ({' / '.join(MLP_NAMES)})")


def _child(module: nn.Module, names: tuple[str, ...], role: re.Pattern | None = None) -> nn.Module | None:
    """The child called one of ``names``, else the only child whose class name matches ``role``."""
    named = next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), nn.Module)), None)
    if named is not None or role is None:
        return named
    matching = [child for child in module.children() if role.search(type(child).__name__)]
    return matching[0] if len(matching) == 1 else None


def attention_of(layer: nn.Module) -> nn.Module | None:
    """The self-attention module of a decoder layer (by its usual names, else the only child whose class is an
    attention, e.g. GPT-NeoX's ``attention``), or ``None`` (e.g. a linear-attention layer of a hybrid). Where that
    module wraps one attention (DBRX's norm-attention-norm block), the innermost: the module that calls the
    attention interface."""
    attention = _child(layer, ATTENTION_NAMES, _ATTENTION_CLASS)
    while attention is not None and (inner := _child(attention, ATTENTION_NAMES, _ATTENTION_CLASS)) is not None:
        attention = inner
    return attention


def mlp_of(layer: nn.Module) -> nn.Module:
    """The MLP (dense or mixture of experts) of a decoder layer (by its usual names, else the only child whose class
    is an MLP, feed-forward or mixture of experts, e.g. MPT's and DBRX's ``ffn``)."""
    return _child(layer, MLP_NAMES, _MLP_CLASS)


def _output_class(model: PreTrainedModel) -> type[ModelOutput]:
    try:
        annotation = typing.get_type_hints(type(model).forward).get("return")
    except Exception:  # annotations naming types the module does not import
        annotation = inspect.signature(type(model).forward).return_annotation
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, ModelOutput):
            return candidate
    return CausalLMOutputWithPast


def describe(model: PreTrainedModel) -> Structure:
    """The :class:`Structure` of ``model``, a decoder-only causal LM.

    Raises:
        ValueError: ``model`` is not one hf_memo can patch exactly; the message names the model and what blocks it.
    """
    config = model.config
    text = config.get_text_config()
    if model.get_output_embeddings() is None:
        raise refuse(model, "it has no LM head (output embeddings): hf_memo patches causal language models")
    if getattr(config, "is_encoder_decoder", False):
        raise refuse(model, "encoder-decoder models are not supported, only decoder-only causal LMs")
    for name, reason in _REFUSED_CONFIG_TRAITS.items():
        if getattr(text, name, None):
            raise refuse(model, f"{reason} (config.{name}={getattr(text, name)!r})")
    prefix, parent, layers = _layer_list(model)
    for index, layer in enumerate(layers):
        if attention_of(layer) is None:
            kinds = sorted({type(c).__name__ for c in layer.children()})
            raise refuse(
                model,
                f"decoder layer {index} has no softmax self-attention ({', '.join(kinds)}): hybrid layers (linear "
                "attention, state-space) are not supported",
            )
    norm = next((n for n in FINAL_NORM_NAMES if isinstance(getattr(parent, n, None), nn.Module)), None)
    if norm is None:  # the only norm beside the layers, whatever its name (GPT-NeoX's final_layer_norm, MPT's norm_f)
        norms = [n for n, child in parent.named_children() if _NORM_CLASS.search(type(child).__name__)]
        norm = norms[0] if len(norms) == 1 else None
    if norm is None:
        raise refuse(model, f"found no final norm ({' / '.join(FINAL_NORM_NAMES)}) beside its decoder layers")
    return Structure(
        model_type=config.model_type,
        backbone=backbone_of(model),
        layers=list(layers),
        mlps=[mlp_of(layer) for layer in layers],
        final_norm=f"{prefix}.{norm}" if prefix else norm,
        logits=confirmed_logit_transform(model),
        output_class=_output_class(model),
        mlp_width=mlp_width(text),
    )
