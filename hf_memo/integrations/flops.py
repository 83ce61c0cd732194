"""Model FLOPs of a training step, the real tokens of a batch, and the peak rate of known GPUs: what MFU counts.

Model FLOPs follow the MEMO/MsT papers' convention, made exact for frozen weights and for packed or
padded rows. Per real (non-padding) token, a weight of a matrix product costs 2 FLOPs forward, 2 for
the gradient of its input and 2 for its own gradient: 6 for a trainable weight, 4 for a frozen one
(LoRA's base weights: forward and input gradient only). Embedding lookups cost nothing (a tied LM head
is still a matrix product and counts once). Causal attention over a sample of ``s`` tokens costs
``6 * n * a * s**2`` (``n`` layers, ``a`` query width ``heads * head_dim``; scores and values, half the
square, forward and backward), so a packed row of samples ``s_i`` costs ``Σ s_i**2``, not ``S**2``.
Recomputation is not counted: it is overhead, not model work.

Used by :class:`~hf_memo.integrations.trainer.MemoCallback` and by the benchmark suite, so both report
the same MFU for the same step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_memo.patches.apply import causal_lm_of

# bf16 dense tensor-core peak FLOP/s of one GPU (vendor data sheets), by a word of torch.cuda.get_device_name().
# More specific names come first: "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" before "NVIDIA H100 80GB HBM3" (SXM).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def peak_flops_of(device_name: str) -> float | None:
    """The bf16 dense peak FLOP/s of a GPU called ``device_name`` (as CUDA names it), or ``None`` if unknown.

    Matched by whole words, case-insensitively: ``"NVIDIA H100 80GB HBM3"`` (SXM) -> 989e12,
    ``"NVIDIA H100 PCIe"`` -> 756e12, ``"NVIDIA A100-SXM4-80GB"`` -> 312e12, ``"NVIDIA GeForce RTX 3090"`` -> None.
    """
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(rf"\b{re.escape(pattern)}\b", device_name, flags=re.IGNORECASE):
            return flops
    return None


def _numel(param: nn.Parameter) -> int:
    return int(getattr(param, "ds_numel", param.numel()))  # DeepSpeed ZeRO-3 partitions hold a slice


def _routed_fraction(config: Any) -> float:
    """The share of a mixture of experts' weights one token goes through: ``top_k / experts`` (1 for dense models)."""
    experts = next(
        (
            getattr(config, n)
            for n in ("num_experts", "num_local_experts", "n_routed_experts")
            if getattr(config, n, None)
        ),
        0,
    )
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None) or experts
    return top_k / experts if experts else 1.0


@dataclass(frozen=True)
class FlopModel:
    """What the model FLOPs of a step depend on.

    Attributes:
        trainable: elements of trainable weights taking part in matrix products (not embedding lookups); a mixture of
            experts counts the share one token goes through (``top_k / experts`` of the experts' weights).
        frozen: the same for frozen weights.
        layers: decoder layers ``n``.
        attention_width: query width ``a`` = attention heads x head dimension.
    """

    trainable: int
    frozen: int
    layers: int
    attention_width: int

    @classmethod
    def of(cls, model: nn.Module) -> FlopModel:
        """The counts of a ``*ForCausalLM`` (or a PEFT model wrapping one) as it will train now."""
        causal_lm = causal_lm_of(model)
        head = causal_lm.get_output_embeddings()
        head_weight = None if head is None else head.weight
        lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - {id(head_weight)}
        text = causal_lm.config.get_text_config()
        routed = _routed_fraction(text)
        trainable = frozen = 0
        seen: set[int] = set()
        for name, param in model.named_parameters():
            if id(param) in seen or id(param) in lookups:
                continue
            seen.add(id(param))
            count = _numel(param) * (routed if ".experts." in f".{name}" else 1)
            if param.requires_grad:
                trainable += count
            else:
                frozen += count
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(round(trainable), round(frozen), text.num_hidden_layers, text.num_attention_heads * head_dim)

    def flops(self, tokens: int, squared_lengths: int) -> float:
        """Model FLOPs of forward + backward over samples of lengths ``s_i``.

        Args:
            tokens: ``Σ s_i``, the real tokens.
            squared_lengths: ``Σ s_i**2`` (for one unpadded sequence of ``S`` tokens: ``S**2``).

        Returns:
            ``(6 * trainable + 4 * frozen) * Σ s_i + 6 * n * a * Σ s_i**2``.
        """
        return (6.0 * self.trainable + 4.0 * self.frozen) * tokens + 6.0 * self.layers * self.attention_width * (
            squared_lengths
        )


def token_counts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ s_i, Σ s_i**2)`` over the samples of a batch, as 0-dim int64 tensors on its device (no host sync).

    A row holds one sample, or several packed ones when ``position_ids`` restart (a sample begins
    wherever a position is not its predecessor's plus one, as transformers detects packed rows);
    tokens whose 2-D ``attention_mask`` is 0 are padding and belong to no sample.

    Args:
        input_ids: ``(B, S)`` (only its shape and device are used; ``inputs_embeds`` ``(B, S, H)`` works too).
        attention_mask: ``(B, S)`` ones for real tokens, or ``None`` (all real; other mask shapes: all real).
        position_ids: ``(B, S)`` or ``(1, S)``, or ``None`` (one sample per row).
    """
    batch, seq_len = input_ids.shape[:2]
    device = input_ids.device
    real = torch.ones(batch, seq_len, dtype=torch.int64, device=device)
    if attention_mask is not None and attention_mask.dim() == 2:
        real = (attention_mask != 0).to(torch.int64)
    sample = torch.zeros(batch, seq_len, dtype=torch.int64, device=device)
    if position_ids is not None:
        positions = position_ids.expand(batch, seq_len)
        restarts = torch.ones_like(positions, dtype=torch.int64)
        restarts[:, 1:] = (positions[:, 1:] - positions[:, :-1] != 1).to(torch.int64)
        sample = restarts.cumsum(dim=1) - 1
    key = sample + seq_len * torch.arange(batch, device=device).unsqueeze(1)  # unique per (row, sample)
    lengths = torch.zeros(batch * seq_len, dtype=torch.int64, device=device).index_add_(
        0, key.flatten(), real.flatten()
    )
    return lengths.sum(), (lengths * lengths).sum()
