"""Workloads: a model shape built from a config (random weights) and how it is trained (LoRA or full)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GiB = 2**30

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Workload:
    """One model and training setup.

    Attributes:
        name: registry key.
        description: one line for tables.
        shape: ``LlamaConfig`` keyword arguments of the real model.
        tiny_shape: ``LlamaConfig`` keyword arguments of the dry-run stand-in (same proportions, CPU-sized).
        lora_rank: LoRA rank on every projection of every layer (base weights frozen), or ``None``
            for full fine-tuning.
        dtype: parameter and compute dtype.
        dry_run_capacity: bytes of device memory the dry run emulates: a step whose peak is larger
            counts as out of memory, so the dry run exercises the longest-sequence search.
    """

    name: str
    description: str
    shape: dict[str, Any]
    tiny_shape: dict[str, Any]
    lora_rank: int | None
    dtype: str = "bfloat16"
    dry_run_capacity: int = 0

    def config_kwargs(self, dry_run: bool) -> dict[str, Any]:
        """``LlamaConfig`` keyword arguments for the real run or the dry run."""
        return dict(self.tiny_shape if dry_run else self.shape)


_LLAMA_COMMON = dict(
    max_position_embeddings=1 << 20,
    rms_norm_eps=1e-5,
    attention_dropout=0.0,
    attn_implementation="sdpa",
    use_cache=False,
)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="llama3-8b-lora",
            description="Llama-3-8B shapes, bf16, LoRA r=16 on all projections",
            shape=dict(
                _LLAMA_COMMON,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                vocab_size=128256,
                rope_theta=500000.0,
                tie_word_embeddings=False,
            ),
            tiny_shape=dict(
                _LLAMA_COMMON,
                hidden_size=64,
                intermediate_size=224,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=2048,
                tie_word_embeddings=False,
            ),
            lora_rank=16,
            dry_run_capacity=8 * 2**20,
        ),
        Workload(
            name="llama3.2-1b-full",
            description="Llama-3.2-1B shapes, bf16, full fine-tuning (AdamW)",
            shape=dict(
                _LLAMA_COMMON,
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                vocab_size=128256,
                rope_theta=500000.0,
                tie_word_embeddings=True,
            ),
            tiny_shape=dict(
                _LLAMA_COMMON,
                hidden_size=64,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=4096,
                tie_word_embeddings=True,
            ),
            lora_rank=None,
            dry_run_capacity=10 * 2**20,
        ),
    )
}


def workload(name: str) -> Workload:
    """The workload called ``name``; ``ValueError`` lists the known ones."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
