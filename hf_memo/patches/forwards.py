"""The forwards hf_memo installs: mini-sequence MLP, and the causal LM with the mini-sequence loss.

Each is called as ``impl(config, ..., module, inner, *args, **kwargs)`` where ``inner`` is the
forward it replaced (see :class:`hf_memo.patches.installed.InstalledForward`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_memo.config import MemoConfig
from hf_memo.minseq.chunking import resolve_chunks
from hf_memo.minseq.lm_head import causal_lm_loss
from hf_memo.minseq.mlp import minseq_mlp
from hf_memo.parallel.causal_lm import SequenceParallelLM
from hf_memo.patches.family import Family


def trainable_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``module`` that currently require a gradient."""
    return [p for p in module.parameters() if p.requires_grad]


def mlp_forward(config: MemoConfig, width: int, module: nn.Module, inner: Callable, x: torch.Tensor) -> torch.Tensor:
    """MLP over ``x`` ``(B, S, H)`` in mini-sequences; ``width`` is the MLP's intermediate size ``I``."""
    tokens = x.numel() // x.shape[-1]
    chunks = resolve_chunks(config.mlp_chunks, tokens, width, x.shape[-1], config.min_chunk_tokens)
    return minseq_mlp(inner, x, trainable_params(module), chunks)


def _keeps_all_logits(logits_to_keep: Any) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def causal_lm_forward(
    config: MemoConfig,
    family: Family,
    sequence_parallel: SequenceParallelLM | None,
    model: PreTrainedModel,
    inner: Callable,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``*ForCausalLM.forward`` whose training loss runs the LM head in mini-sequences.

    In training with ``labels`` (and all logits requested) the backbone runs as usual, then the
    loss is computed from the ``(B, S, H)`` hidden states without building ``(B, S, V)`` logits;
    ``logits`` is ``None`` in the output. Everything else (evaluation,
    ``generate()``, calls without labels) goes to the original forward unchanged.
    With ``sequence_parallel``, the backbone and the loss run on this rank's shard of the sequence
    and the loss is summed over the sequence-parallel group; the other outputs are the shard's.
    """
    signature = inspect.signature(inner)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    var_keyword = next(n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD)
    extra = dict(arguments.pop(var_keyword, {}))
    labels = arguments.pop("labels", None)
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    if not model.training or labels is None or not _keeps_all_logits(logits_to_keep):
        if sequence_parallel is not None:
            return sequence_parallel.unsplit_forward(model, inner, *args, **kwargs)
        return inner(*args, **kwargs)
    if sequence_parallel is not None:
        arguments, extra = sequence_parallel.shard(arguments, extra, labels)

    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = model.config.return_dict
    backbone = getattr(model, model.base_model_prefix)
    outputs = backbone(**arguments, **extra)
    hidden = outputs.last_hidden_state
    head = model.get_output_embeddings()
    vocab_size = model.config.get_text_config().vocab_size
    tokens = hidden.numel() // hidden.shape[-1]
    chunks = resolve_chunks(config.lm_head_chunks, tokens, vocab_size, hidden.shape[-1], config.min_chunk_tokens)
    loss = causal_lm_loss(
        hidden,
        head,
        trainable_params(head),
        labels,
        chunks,
        ignore_index=extra.get("ignore_index", -100),
        num_items_in_batch=extra.get("num_items_in_batch"),
        shift_labels=extra.get("shift_labels"),
    )
    if sequence_parallel is not None:
        loss = sequence_parallel.reduce_loss(loss)
    passthrough = {f.name for f in dataclasses.fields(family.output_class)} - {"loss", "logits"}
    result = family.output_class(loss=loss, **{name: outputs.get(name) for name in passthrough})
    return result if return_dict else result.to_tuple()
