"""Cutting one causal-LM batch into the sequence shards of a sequence-parallel group (no communication).

Every rank of the group holds the same ``(B, S)`` batch and keeps shard ``rank`` of it:

- labels are shifted *before* cutting (``shift_labels[:, t]`` is the target of token ``t``), so the
  token at a shard border still predicts the first token of the next shard;
- ``position_ids`` are those of the whole sequence, one sequence per row (packed rows, whose
  positions restart, are refused);
- ``S`` is padded at the end to a multiple of the group size with ignored targets; padding at the
  end of a causal sequence is never attended to by real tokens, so no attention mask is needed.
  Padded positions continue the row's (so the model sees no new packed sequence), capped at the
  model's last position when the real ones stay below it (learned position tables);
- an ``attention_mask`` may only mark right padding (real tokens first), and padded tokens must
  have no target: then dropping the mask leaves every counted token's output unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

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


def check_right_padding(attention_mask: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int) -> None:
    """``attention_mask`` ``(B, S)`` may only mark right padding, and padded tokens must have no target.

    Raises:
        ValueError: for a mask that is not 2-D, has a masked token before a real one, or masks a token
            whose target counts in the loss.
    """
    if attention_mask.dim() != 2:
        raise ValueError(
            f"sequence parallelism accepts a (batch, seq_len) attention_mask, got shape {tuple(attention_mask.shape)}"
        )
    real = attention_mask.bool()
    if bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise ValueError(
            "sequence parallelism supports right padding only (attention_mask ones, then zeros); this mask has a "
            "masked token before a real one (left padding or packed sequences)"
        )
    if bool(((shift_labels != ignore_index) & ~real).any()):
        raise ValueError(
            "sequence parallelism: a padded token (attention_mask 0) has a target; label padding with the ignore index"
        )


def check_one_sequence_per_row(position_ids: torch.Tensor) -> None:
    """``position_ids`` ``(B, S)`` must count up by one along each row (no packed sequences)."""
    if bool((position_ids.diff(dim=-1) != 1).any()):
        raise ValueError(
            "sequence parallelism needs one sequence per row: position_ids must count up by one, but they restart "
            "or jump (packed sequences are not supported)"
        )


def _pad_sequence(x: torch.Tensor, pad: int, value: float) -> torch.Tensor:
    """Pad dimension 1 of ``x`` by ``pad`` entries of ``value``."""
    widths = [0, 0] * (x.dim() - 2) + [0, pad]
    return F.pad(x, widths, value=value) if pad else x


def _pad_positions(position_ids: torch.Tensor, pad: int, max_positions: int | None) -> torch.Tensor:
    """Continue each row of ``position_ids`` ``(B, S)`` for ``pad`` more tokens (capped, see the module docstring)."""
    if pad == 0:
        return position_ids
    tail = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)
    if max_positions is not None and not is_fake(tail) and bool((position_ids < max_positions).all()):
        tail = tail.clamp(max=max_positions - 1)
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

    Raises:
        ValueError: for packed ``position_ids`` or an ``attention_mask`` that is not right padding.
    """
    sequence = arguments["input_ids"] if arguments.get("input_ids") is not None else arguments["inputs_embeds"]
    batch, length = sequence.shape[:2]
    if shift_labels is None:
        shift_labels = shifted_targets(labels, ignore_index)
    shift_labels = shift_labels.to(sequence.device)
    attention_mask = arguments.get("attention_mask")
    if attention_mask is not None:
        check_right_padding(attention_mask.to(sequence.device), shift_labels, ignore_index)
    position_ids = arguments.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(length, device=sequence.device).unsqueeze(0)
    elif not is_fake(position_ids):
        check_one_sequence_per_row(position_ids)
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
