"""The backbone of a causal LM: the module its forward calls with the inputs, before the LM head."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel


def backbone_of(model: PreTrainedModel) -> nn.Module:
    """``getattr(model, model.base_model_prefix)``, else the model's decoder, else its only child beside the LM head
    (Llama 4's text model names its prefix ``language_model`` and holds its backbone as ``model``).

    Raises:
        ValueError: ``model`` has neither.
    """
    backbone = getattr(model, model.base_model_prefix, None)
    if isinstance(backbone, nn.Module) and backbone is not model:
        return backbone
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if isinstance(decoder, nn.Module) and decoder is not model:
        return decoder
    head = model.get_output_embeddings()
    children = [child for child in model.children() if child is not head]
    if len(children) == 1:  # the one module beside the head
        return children[0]
    raise ValueError(
        f"hf_memo cannot patch {type(model).__name__}: it has no backbone (attribute {model.base_model_prefix!r} or a "
        "decoder) to run before its LM head"
    )
