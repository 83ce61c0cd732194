"""Sequence parallelism on one patched causal LM: Ulysses attention, sharded inputs, loss over the group.

In training, every rank of a sequence-parallel group calls the model with the same full batch;
:meth:`SequenceParallelLM.shard` keeps this rank's tokens, the backbone and the mini-sequence MLP and
LM head run on them, and :meth:`SequenceParallelLM.reduce_loss` sums the shards' losses. Each shard's
loss is its summed cross-entropy divided by the valid-token count of the whole batch (or by the
Trainer's ``num_items_in_batch``, counted on the full labels as without sequence parallelism), so
the sum is exactly the unpatched model's loss, and a shard without valid targets adds 0, never NaN.
Gradients: every rank back-propagates that same loss, so each parameter gradient is the group size
times this rank's share; the data-parallel average over the world turns that into the single-process
gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from transformers import PreTrainedModel

from hf_memo.config import MemoConfig
from hf_memo.minseq.lm_head import shifted_targets
from hf_memo.parallel.attention import AttentionConfigView, check_wrappable, register_ulysses_attention
from hf_memo.parallel.collectives import all_gather_tensor, sum_over_group
from hf_memo.parallel.groups import SequenceParallelGroups, sequence_parallel_groups
from hf_memo.parallel.heads import check_head_counts
from hf_memo.parallel.sharding import batch_fingerprint, shard_batch
from hf_memo.runtime.batch_layout import LAYOUT_KEYWORD


def attention_modules(model: PreTrainedModel) -> list[nn.Module]:
    """The self-attention layers of ``model``'s decoder: modules named ``*Attention*`` that hold its text config (the
    model's own config but for multimodal models, whose vision tower's attention is left alone) and a layer index."""
    return [
        module
        for module in model.modules()
        if "Attention" in type(module).__name__
        and getattr(module, "config", None) is model.config.get_text_config()
        and hasattr(module, "layer_idx")
        and not getattr(module, "is_cross_attention", False)
    ]


class SequenceParallelLM:
    """hf_memo's sequence parallelism on one model (see the module docstring).

    Attributes:
        size: the sequence-parallel degree.
        inner_attention: the attention implementation Ulysses wraps (the model's own).
        max_positions: the model's ``max_position_embeddings`` (padding positions stay below it).
        attention: the ``AttentionInterface`` key of the Ulysses wrapper the attention layers now use.
    """

    def __init__(self, size: int, inner_attention: str, attention: str, max_positions: int | None) -> None:
        self.size = size
        self.inner_attention = inner_attention
        self.attention = attention
        self.max_positions = max_positions
        self._checked_once = False
        self._pending_check: tuple[torch.Tensor, torch.cuda.Event] | None = None

    @classmethod
    def install(cls, model: PreTrainedModel, config: MemoConfig, record: Any) -> SequenceParallelLM | None:
        """Switch ``model``'s attention layers to Ulysses when ``config.sequence_parallel_size > 1`` (else ``None``).

        Each attention layer gets an :class:`AttentionConfigView` naming the Ulysses wrapper; the
        model's config is left alone (it may be shared with other models). ``record`` (a
        :class:`~hf_memo.patches.installed.PatchRecord`) keeps what to restore on revert. Head counts
        and attention implementation are checked now, the world size too if a process group exists
        (otherwise at the first training step).
        """
        size = config.sequence_parallel_size
        if size == 1:
            return None
        text = model.config.get_text_config()
        heads = text.num_attention_heads
        check_head_counts(size, heads, getattr(text, "num_key_value_heads", None) or heads)
        inner = model.config.get_text_config()._attn_implementation
        check_wrappable(inner)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            sequence_parallel_groups(size)
        layers = attention_modules(model)
        if not layers:
            raise ValueError(f"sequence parallelism found no attention layers in {type(model).__name__}")
        attention = register_ulysses_attention(inner, size)
        for layer in layers:
            record.set(layer, "config", AttentionConfigView(layer.config, attention))
        return cls(size, inner, attention, getattr(text, "max_position_embeddings", None))

    @property
    def groups(self) -> SequenceParallelGroups:
        """This rank's sequence-parallel groups (``ValueError`` without a suitable process group)."""
        return sequence_parallel_groups(self.size)

    def unsplit_forward(self, model: PreTrainedModel, inner: Any, *args: Any, **kwargs: Any) -> Any:
        """A forward that is not a sequence-parallel training step: evaluation, generation, no labels.

        Raises:
            ValueError: in training mode, where every forward must be a sequence-parallel loss step.
        """
        if model.training:
            raise ValueError(
                f"with MemoConfig.sequence_parallel_size={self.size}, a training forward must compute the loss "
                "(pass labels, and no logits_to_keep); call model.eval() for other uses"
            )
        return inner(*args, **kwargs)

    def shard(self, arguments: dict, extra: dict, labels: torch.Tensor | None) -> tuple[dict, dict[str, Any]]:
        """This rank's shard of the batch, as (model arguments, loss keyword arguments).

        Args:
            arguments: the model's named arguments (full ``(B, S)`` sequence, equal on the whole group),
                with the samples of the whole rows under ``LAYOUT_KEYWORD`` (absent for a 4-D
                ``attention_mask``: refused).
            extra: its ``**kwargs`` (``shift_labels``, ``num_items_in_batch``, ``ignore_index``, ...).
            labels: the ``(B, S)`` labels.

        Returns:
            The arguments for the backbone (``(B, S_pad / sp)`` tokens, the batch's ``position_ids``,
            an empty 4-D attention mask so transformers builds none, no cache, and the layout over
            the ``S_pad`` tokens every rank attends over after the exchange), and ``extra`` with
            ``shift_labels`` ``(B, S_pad / sp)`` and ``num_items_in_batch`` set (the Trainer's value,
            else the whole batch's target count).

        Raises:
            ValueError: no suitable process group, a 4-D attention mask, or ranks of the group hold
                different batches.
        """
        layout = arguments.get(LAYOUT_KEYWORD)
        if layout is None:
            raise ValueError(
                "sequence parallelism takes a (batch, seq_len) attention_mask or packed position_ids, got a 4-D "
                "attention_mask"
            )
        groups = self.groups
        ignore_index = extra.get("ignore_index", -100)
        shift_labels = extra.get("shift_labels")
        if shift_labels is None:
            shift_labels = shifted_targets(labels, ignore_index)
        self._check_same_batch(arguments, shift_labels, groups)
        arguments = {name: value for name, value in arguments.items() if name not in ("attention_mask", LAYOUT_KEYWORD)}
        shard = shard_batch(
            arguments, labels, shift_labels, groups.sp_rank, self.size, ignore_index, self.max_positions
        )
        batch = shard.shift_labels.shape[0]
        # The shard's attention is the layout's, applied after the exchange; an empty 4-D mask is
        # taken as given by transformers, which then builds no mask of its own for the shard.
        placeholder = torch.ones(batch, 1, 0, 0, dtype=torch.bool, device=shard.shift_labels.device)
        local = {
            **shard.arguments,
            "attention_mask": placeholder,
            "use_cache": False,
            LAYOUT_KEYWORD: layout.padded_to(shard.padded_length),
        }
        num_items = extra.get("num_items_in_batch")
        loss_kwargs = {
            **extra,
            "shift_labels": shard.shift_labels,
            "num_items_in_batch": shard.target_tokens if num_items is None else num_items,
        }
        return local, loss_kwargs

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole batch's loss from this shard's part (summed over the group, differentiable)."""
        return sum_over_group(loss, self.groups.group)

    def _check_same_batch(self, arguments: dict, shift_labels: torch.Tensor, groups: SequenceParallelGroups) -> None:
        """Refuse ranks of the group holding different batches.

        On the host (CPU tensors) and at the first step the check is immediate; later steps on an
        accelerator compare on the device and read the verdict one step later, so the check never
        stalls the host (a mismatch is reported at the latest by the next step, on every rank).
        """
        fingerprint = batch_fingerprint(arguments, shift_labels)
        if is_fake(fingerprint):  # profiling on fake tensors: there are no values to compare
            return
        pending, self._pending_check = self._pending_check, None
        if pending is not None:
            verdict, copied = pending
            copied.synchronize()  # recorded a step ago: long done
            self._raise_if_different(bool(verdict))
        same = (all_gather_tensor(fingerprint, groups.group) == fingerprint).all()
        if same.device.type == "cpu" or not self._checked_once:
            self._checked_once = True
            self._raise_if_different(bool(same))
            return
        verdict = same.to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._pending_check = (verdict, copied)

    def _raise_if_different(self, same: bool) -> None:
        if not same:
            raise ValueError(
                f"the {self.size} ranks of a sequence-parallel group must get the same batch, but they got different "
                "ones: prepare the data loader with hf_memo.integrations.accelerate.attach(accelerator, model) "
                "(the sequence-parallel ranks then share the data-parallel shard)"
            )
