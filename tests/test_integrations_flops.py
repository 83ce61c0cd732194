"""Model FLOPs, real-token counts and GPU peaks (hf_memo/integrations/flops.py), against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_memo.integrations.flops import FlopModel, peak_flops_of, token_counts
from tests.conftest import build_model
from tests.model_catalog import build_catalog_model

# The tiny llama of tests/conftest.py: V=101, H=32, I=72, 2 layers, 4 heads of 8, 2 KV heads.
LLAMA_LAYER = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 72 + 2 * 32  # q, k, v, o, MLP, two norms: 10048
LLAMA_MATMUL = 2 * LLAMA_LAYER + 32 + 101 * 32  # layers, final norm, LM head (no embedding): 23360


@pytest.mark.parametrize("tied", [False, True])
def test_llama_counts_every_weight_but_the_embedding_lookup_and_a_tied_head_once(tied):
    model = build_model("llama", tie_word_embeddings=tied)
    assert FlopModel.of(model) == FlopModel(trainable=LLAMA_MATMUL, frozen=0, layers=2, attention_width=32)
    assert sum(p.numel() for p in model.parameters()) == LLAMA_MATMUL + (0 if tied else 101 * 32)


def test_gpt2_leaves_out_both_lookups_and_keeps_its_tied_head():
    layer = 2 * 64 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)  # norms, attn, MLP
    expected = 2 * layer + 64 + 101 * 32  # layers, ln_f, tied head; wte and wpe (512 x 32) are lookups
    assert FlopModel.of(build_model("gpt2")) == FlopModel(trainable=expected, frozen=0, layers=2, attention_width=32)


def test_lora_base_weights_are_frozen_and_adapters_trainable():
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(build_model("llama"), lora)
    adapters = 2 * ((2 * 32 + 32 * 2) + (2 * 32 + 16 * 2))  # per layer A (r, in) + B (out, r) of q and v
    assert FlopModel.of(model) == FlopModel(trainable=adapters, frozen=LLAMA_MATMUL, layers=2, attention_width=32)


def test_flops_count_6_per_trainable_4_per_frozen_weight_and_attention_per_sample():
    model = FlopModel(trainable=10, frozen=20, layers=2, attention_width=3)
    # (6 * 10 + 4 * 20) * 5 tokens + 6 * 2 * 3 * (3**2 + 2**2)
    assert model.flops(tokens=5, squared_lengths=13) == 140 * 5 + 36 * 13 == 1168
    assert FlopModel(LLAMA_MATMUL, 0, 2, 32).flops(9, 29) == 6 * 23360 * 9 + 6 * 2 * 32 * 29 == 1272576


def _counts(*args) -> tuple[int, int]:
    tokens, squared = token_counts(*args)
    assert tokens.dtype == squared.dtype == torch.int64 and tokens.dim() == squared.dim() == 0
    return int(tokens), int(squared)


def test_token_counts_of_unpadded_padded_and_packed_rows():
    ids = torch.zeros(2, 9, dtype=torch.long)
    assert _counts(ids) == (18, 2 * 81)
    right = torch.tensor([[1] * 9, [1] * 4 + [0] * 5])
    assert _counts(ids, right) == (13, 81 + 16)
    left = torch.tensor([[0] * 2 + [1] * 7, [0] * 6 + [1] * 3])
    assert _counts(ids, left) == (10, 49 + 9)
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # samples of 3, 2 and 4 tokens; shared by both rows
    assert _counts(ids, None, packed) == (18, 2 * (9 + 4 + 16))
    both = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 0, 1, 2, 0, 0, 0, 0]])  # row 2: 2 + 3, then padding
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    assert _counts(ids, mask, both) == (14, 81 + 4 + 9)
    embeds = torch.zeros(1, 9, 4)
    assert _counts(embeds, None, packed) == (9, 29)


@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 SXM5 80GB", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("nvidia h100 pcie", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA GeForce RTX 3090", None),
        ("NVIDIA H1000", None),
    ],
)
def test_peak_flops_of_known_gpus_and_none_for_others(name, flops):
    assert peak_flops_of(name) == flops


def test_a_mixture_of_experts_counts_the_experts_one_token_goes_through():
    """Qwen3-MoE with 4 experts, top 2: a token multiplies by half of the experts' weights, all of the rest."""
    model = build_catalog_model("qwen3_moe")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n and "embed_tokens" not in n)
    assert experts > 0 and model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    assert FlopModel.of(model).trainable == rest + experts // 2
