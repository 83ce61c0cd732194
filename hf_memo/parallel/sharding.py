"""Cutting one causal-LM batch into the sequence shards of a sequence-parallel group (no communication).

Every rank of the group holds the same ``(B, S)`` batch and keeps shard ``rank`` of it:

- labels are shifted *before* cutting (``shift_labels[:, t]`` is the target of token ``t``), so the
  token at a shard border still predicts the first token of the next shard;
- ``position_ids`` are those of the whole batch: each token keeps its position in its own sample,
  whether a row holds one sample or several packed ones (which samples attend to which is the
  step's :class:`~hf_memo.runtime.batch_layout.BatchLayout`, applied after the exchange);
- ``S`` is padded at the end to a multiple of the group size with ignored targets; padding at the
  end of a row is never attended to by real tokens. Padded positions continue the row's (so the
  padding looks like no new sample), capped at the model's last position when the row's real ones
  stay below it (learned position tables);
- the ``attention_mask`` is dropped: the layout holds the padding it marked.

Nothing here reads tensor values on the host: cutting a batch costs no device synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_memo.minseq.lm_head import shifted_targets


@dataclass(frozen=True)
class SequenceShard:
    """One rank's part of a batch.

    Attributes:
        arguments: the model arguments with every per-token tensor cut to ``(B, S_pad / sp, ...)``,
            ``position_ids`` always present, no ``attention_mask``.
        shift_labels: ``(B, S_pad / sp)`` targets of this shard's tokens.
        target_tokens: number of non-ignored targets in the whole batch (a 0-dim tensor).
        padded_length: ``S_pad``, the sequence length after padding to a multiple of ``sp``.
    """

    arguments: dict
    shift_labels: torch.Tensor
    target_tokens: torch.Tensor
    padded_length: int


def _pad_sequence(x: torch.Tensor, pad: int, value: float) -> torch.Tensor:
    """Pad dimension 1 of ``x`` by ``pad`` entries of ``value``."""
    widths = [0, 0] * (x.dim() - 2) + [0, pad]
    return F.pad(x, widths, value=value) if pad else x


def _pad_positions(position_ids: torch.Tensor, pad: int, max_positions: int | None) -> torch.Tensor:
    """Continue each row of ``position_ids`` ``(B, S)`` for ``pad`` more tokens (capped, see the module docstring)."""
    if pad == 0:
        return position_ids
    last = position_ids[:, -1:]
    tail = last + torch.arange(1, pad + 1, device=position_ids.device)
    if max_positions is not None:
        tail = torch.where(last < max_positions, tail.clamp(max=max_positions - 1), tail)
    return torch.cat([position_ids, tail], dim=1)


def shard_batch(
    arguments: dict,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    sp_rank: int,
    sp_size: int,
    ignore_index: int = -100,
    max_positions: int | None = None,
) -> SequenceShard:
    """Shard ``sp_rank`` of ``sp_size`` of a causal-LM batch.

    Args:
        arguments: the model's keyword arguments (``input_ids`` ``(B, S)`` or ``inputs_embeds``
            ``(B, S, H)``, optional ``attention_mask``, ``position_ids``, ``token_type_ids``, ...).
        labels: ``(B, S)`` unshifted labels, used when ``shift_labels`` is ``None``.
        shift_labels: ``(B, S)`` labels already shifted.
        sp_rank, sp_size: which shard of how many.
        ignore_index: the label of tokens without a target.
        max_positions: the model's ``max_position_embeddings`` (caps padded positions), or ``None``.

    Returns:
        The :class:`SequenceShard`. Padded tokens get input id 0 (embedding zeros), continued
        position ids, and no target.
    """
    sequence = arguments["input_ids"] if arguments.get("input_ids") is not None else arguments["inputs_embeds"]
    batch, length = sequence.shape[:2]
    if shift_labels is None:
        shift_labels = shifted_targets(labels, ignore_index)
    shift_labels = shift_labels.to(sequence.device)
    position_ids = arguments.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(length, device=sequence.device).unsqueeze(0)
    local = {name: value for name, value in arguments.items() if name != "attention_mask"}

    pad = -length % sp_size
    shard_length = (length + pad) // sp_size
    start, stop = sp_rank * shard_length, (sp_rank + 1) * shard_length
    local["position_ids"] = _pad_positions(position_ids.expand(batch, length), pad, max_positions)[:, start:stop]
    pad_values = {"input_ids": 0, "inputs_embeds": 0.0, "token_type_ids": 0}
    for name, value in pad_values.items():
        if local.get(name) is not None:
            local[name] = _pad_sequence(local[name], pad, value)[:, start:stop]
    shard_labels = _pad_sequence(shift_labels, pad, ignore_index)[:, start:stop]
    return SequenceShard(local, shard_labels, (shift_labels != ignore_index).sum(), length + pad)


def batch_fingerprint(arguments: dict, shift_labels: torch.Tensor) -> torch.Tensor:
    """``(4,)`` int64 summary of a batch (shape, token ids, targets): equal on ranks that hold the same batch."""
    ids = arguments.get("input_ids")
    sequence = ids if ids is not None else arguments["inputs_embeds"]
    weights = torch.arange(1, sequence.shape[1] + 1, device=shift_labels.device) % 1009 + 1

    def digest(values: torch.Tensor) -> torch.Tensor:
        return (values.to(shift_labels.device, torch.int64) * weights).sum()

    ids_digest = digest(ids) if ids is not None else shift_labels.new_zeros((), dtype=torch.int64)
    shape = torch.tensor(sequence.shape[:2], device=shift_labels.device, dtype=torch.int64)
    return torch.cat([shape, ids_digest.view(1), digest(shift_labels).view(1)])
