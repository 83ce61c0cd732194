"""A training step's batch as transformers must see it, and its :class:`~hf_memo.runtime.batch_layout.BatchLayout`.

Called once per training step with labels, before the backbone runs. transformers honours packed
samples (``position_ids`` restarting) only without an ``attention_mask`` and without a cache; so
an ``attention_mask`` that marks no padding is dropped (it would hide the packing), and the caller
turns the cache off. What the layout cannot express, or transformers would get wrong, is refused by
:func:`~hf_memo.runtime.batch_layout.describe_batch`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_memo.minseq.lm_head import shifted_targets
from hf_memo.parallel.attention import WRAPPABLE
from hf_memo.patches.sample_attention import attends_per_sample
from hf_memo.runtime.batch_layout import LAYOUT_KEYWORD, describe_batch, needs_masks_transformers_lacks

# Attention implementations that see packed samples: through the mask transformers builds from
# position_ids (eager, sdpa, flex) or through position_ids themselves (flash-attention).
FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
PACKING_AWARE = ("eager", "sdpa", "flex_attention", *FLASH)


def describe_training_batch(
    model: PreTrainedModel, arguments: dict, labels: Any, extra: dict, per_sample: bool = False
) -> dict:
    """The arguments of a training step of ``model``, with the batch's layout under ``LAYOUT_KEYWORD``.

    Args:
        model: the causal LM.
        arguments: its named forward arguments (``input_ids`` ``(B, S)`` or ``inputs_embeds``
            ``(B, S, H)``, optional ``attention_mask`` ``(B, S)``, ``position_ids`` ``(B, S)``).
        labels: ``(B, S)`` labels, or ``None`` when the caller computes its loss itself (the targets are then
            unknown and not checked against padding).
        extra: the forward's ``**kwargs`` (``shift_labels``, ``ignore_index``).
        per_sample: every attention call of the step attends per sample whatever the model's
            implementation (sequence parallelism's Ulysses attention does).

    Returns:
        The arguments with the layout added (none for a 4-D ``attention_mask``, which transformers
        applies as given) and without an ``attention_mask`` that marks no padding. When the model
        attends per sample (:mod:`.sample_attention`) and the layout is not plain, the mask is an
        empty 4-D one: transformers takes it as given and builds none. A batch whose padding after
        real tokens has targets (``padding_attends``; not with flash attention, whose padding gets no
        attention in transformers either) keeps its 2-D mask: the attention implementations
        then use transformers' own masks, which give that padding the attention it is trained with, and
        the memo executor, which reads no mask, the layout's padding blocks (the same attention).

    Raises:
        ValueError: see :func:`describe_batch`; also padding together with packed samples where
            transformers' masks would attend across them, packed samples with an attention
            implementation that ignores them, and padding with targets under sequence parallelism.
    """
    mask = arguments.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return arguments
    sequence = arguments["input_ids"] if arguments.get("input_ids") is not None else arguments["inputs_embeds"]
    batch, length = sequence.shape[:2]
    ignore_index = extra.get("ignore_index", -100)
    shift_labels = extra.get("shift_labels")
    if shift_labels is None and labels is not None:
        shift_labels = shifted_targets(labels, ignore_index)
    layout = describe_batch(batch, length, mask, arguments.get("position_ids"), shift_labels, ignore_index)
    implementation = model.config.get_text_config()._attn_implementation
    if layout.padding_attends and implementation in FLASH:
        # transformers' flash-attention path unpads the batch: its padding queries get no attention, targets or not.
        layout = dataclasses.replace(layout, padding_attends=False)
    if layout.padding_attends:
        if layout.packed:
            raise ValueError(
                "a padding token after real tokens (attention_mask 0) has a target in the labels of a batch with "
                "packed samples; label padding with the ignore index (-100)"
            )
        if per_sample:
            raise ValueError(
                "a padding token after real tokens (attention_mask 0) has a target in the labels, and sequence "
                "parallelism attends per sample (padding gets no attention there); label padding with the ignore "
                "index (-100)"
            )
        return {**arguments, LAYOUT_KEYWORD: layout}
    if needs_masks_transformers_lacks(layout, batch) and not (per_sample or attends_per_sample(model)):
        raise ValueError(
            "this batch has padding (attention_mask zeros) and packed samples (position_ids restarting inside a "
            f"row): with attn_implementation={implementation!r} transformers' masks let the packed samples attend "
            "to each other. Use padding-free packing (position_ids, no attention_mask), one sample per row with "
            f"padding, or one of {', '.join(WRAPPABLE)}"
        )
    if layout.packed and implementation not in PACKING_AWARE:
        raise ValueError(
            f"this batch packs several samples per row (position_ids restart), which attn_implementation="
            f"{implementation!r} ignores (samples would attend to each other); use one of {', '.join(PACKING_AWARE)}"
        )
    arguments = {name: value for name, value in arguments.items() if name != "attention_mask"}
    if attends_per_sample(model) and not layout.plain:
        arguments["attention_mask"] = torch.ones(batch, 1, 0, 0, dtype=torch.bool, device=sequence.device)
    elif mask is not None and layout.real_tokens(batch) < batch * length:
        arguments["attention_mask"] = mask
    return {**arguments, LAYOUT_KEYWORD: layout}
