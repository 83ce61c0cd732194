"""Wiring of the third-party contenders into a Hugging Face Llama: Liger-Kernel and DeepSpeed's tiled ops.

Imports of the optional packages happen inside the functions, so this module imports anywhere.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# DeepSpeed's ALST recipe sizes logits shards at about 1 GiB of fp32 logits each.
_LOGITS_SHARD_BYTES = 2**30


def install_liger_fused_linear_cross_entropy() -> None:
    """Liger-Kernel's fused linear cross-entropy as ``LlamaForCausalLM.forward`` (class-level; nothing else fused)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(
        rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False, swiglu=False
    )


def _gated_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The Llama MLP on rows ``x`` ``(B, s, H)`` -> ``(B, s, H)``."""
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def install_deepspeed_tiled_mlp(causal_lm: nn.Module) -> None:
    """Every decoder layer's MLP runs through DeepSpeed's ``TiledMLP`` with ``ceil(S / H)`` shards.

    The forward is set on each MLP instance (not the decoder layer, whose forward Hugging Face
    checkpointing wraps); the projections are looked up at call time, so LoRA wrapping afterwards works.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def tiled_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
        return TiledMLP.apply(_gated_mlp, mlp, x, shards, list(mlp.parameters()))

    for layer in causal_lm.model.layers:
        layer.mlp.forward = tiled_forward.__get__(layer.mlp)


def deepspeed_tiled_loss(causal_lm: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy through DeepSpeed's ``TiledFusedLogitsLoss`` (logits never full length).

    Args:
        causal_lm: the (possibly LoRA-injected) ``LlamaForCausalLM``.
        input_ids: ``(B, S)`` token ids.
        labels: ``(B, S)`` unshifted labels, ``-100`` ignored.

    ``TiledFusedLogitsLoss`` runs the backward of each shard inside its forward, with an incoming
    gradient of 1, and only scales the input gradient afterwards: dividing its output by the token
    count would leave the LM head's weight gradient unscaled. So every shard returns its summed
    loss already divided by the number of counted tokens of the whole batch, and the shard results
    are summed ("sum" reduction); the loss is then used as is.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    hidden = causal_lm.model(input_ids=input_ids).last_hidden_state  # (B, S, H)
    head = causal_lm.lm_head
    shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]  # (B, S)
    counted = (shift_labels != -100).sum().clamp(min=1)
    vocab = head.out_features

    def shard_loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = module(x).float()  # (rows, V)
        return F.cross_entropy(logits.view(-1, vocab), y.view(-1), ignore_index=-100, reduction="sum") / counted

    shards = max(1, math.ceil(shift_labels.numel() * vocab * 4 / _LOGITS_SHARD_BYTES))
    return TiledFusedLogitsLoss.apply(shard_loss, head, hidden, shift_labels, None, shards, [head.weight], "sum")
