"""Mini-sequence LM head + cross-entropy (MsT algorithms 2 and 4): the ``(S, V)`` logits never exist at full length.

Forward computes each chunk's logits, upcasts them to float32 and sums the chunk's cross-entropy;
backward recomputes the chunks one at a time. The result is ``transformers``' ``ForCausalLMLoss``
(same shift, ``ignore_index``, ``num_items_in_batch`` and ``shift_labels`` semantics).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.minseq.recompute import run_chunked

HeadFunction = Callable[[torch.Tensor], torch.Tensor]


def linear_cross_entropy(
    hidden: torch.Tensor,
    head: HeadFunction,
    params: Sequence[torch.Tensor],
    targets: torch.Tensor,
    chunks: int,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``head(hidden)`` against ``targets``, computed in ``chunks`` mini-sequences.

    Args:
        hidden: ``(N, H)`` final hidden states, one row per predicted token.
        head: the LM head, ``(n, H) -> (n, V)`` (a module call, so LoRA-wrapped heads work).
        params: the head's parameters that may need gradients (empty for a frozen head).
        targets: ``(N,)`` target ids; ``ignore_index`` rows count for nothing.
        chunks: number of mini-sequences (clamped to ``N``).
        num_items_in_batch: divide the summed loss by this (gradient accumulation) instead of
            by the number of non-ignored targets.

    Returns:
        A float32 scalar: ``sum(CE) / num_items_in_batch``, or the mean over non-ignored targets.
    """
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum()
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device)

    def chunk_loss(rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        logits = head(rows).float()
        loss = F.cross_entropy(logits, targets[start:stop], ignore_index=ignore_index, reduction="sum")
        return loss / denominator

    return run_chunked(chunk_loss, hidden, params, chunk_bounds(hidden.shape[0], chunks), "sum")


def shifted_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``(B, S)`` labels -> ``(B, S)`` next-token targets: position ``t`` predicts ``labels[:, t + 1]``.

    The last position of every row gets ``ignore_index``, as in ``ForCausalLMLoss``.
    """
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def causal_lm_loss(
    hidden: torch.Tensor,
    head: HeadFunction,
    params: Sequence[torch.Tensor],
    labels: torch.Tensor | None,
    chunks: int,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal-LM loss of ``head(hidden)``, equal to ``transformers.loss.loss_utils.ForCausalLMLoss``.

    Args:
        hidden: ``(B, S, H)`` final hidden states.
        labels: ``(B, S)`` unshifted labels; ignored when ``shift_labels`` is given.
        shift_labels: ``(B, S)`` labels already shifted (e.g. by sequence-parallel sharding).
        Other arguments as in :func:`linear_cross_entropy`.

    Returns:
        A float32 scalar.
    """
    if shift_labels is None:
        shift_labels = shifted_targets(labels, ignore_index)
    targets = shift_labels.reshape(-1).to(hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1])
    return linear_cross_entropy(rows, head, params, targets, chunks, ignore_index, num_items_in_batch)
