"""A catalog of tiny random causal LMs of every decoder family hf_memo aims to patch, built from configs only.

Each entry is a fp64 model with hidden size 32, 2-3 layers, 4 heads (2 key/value heads where the family has
grouped-query attention) and ``VOCAB`` tokens, with the traits that set its family apart switched on:
sliding windows of ``WINDOW`` tokens (shorter than the test sequences), soft-capping, attention sinks,
NoPE layers, partial rotary, fused projections, post-norms, multipliers, mixture-of-experts layers with their
router loss in the returned loss. The attention implementation is the one transformers picks when a model is
built from a config (SDPA where the family supports it; Gemma 2 and gpt-oss have none and run eager); the
``-eager`` entries add eager attention to families with sliding windows that default to SDPA. Mixture-of-experts
entries run transformers' "eager" experts loop (its default ``grouped_mm`` has no fp64 kernel on the CPU).

The five families the rest of the suite parametrizes over (``tests.conftest.FAMILY_BUILDERS``) stay there;
``llama`` is repeated here as the matrix's control row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

from tests.conftest import VOCAB

WINDOW = 8  # sliding-window length: the test sequences are 21-40 tokens, so windows really cut them
HIDDEN = 32
# What a gradient may differ by, relative to its largest element, where the model computes in fp32 inside (see
# ``CatalogModel.fp32_rounded``): fp32 rounding (1.2e-7) that the patched model re-associates, amplified through the
# layers. Eager and SDPA attention of transformers differ by ~1e-7 (tests/test_patches_structure.py::
# test_fp32_tolerance_is_needed); Gemma 2 with random LoRA weights under memo by up to 1.7e-6 (randomized seed
# 2018 of --catalog), and by 1e-15 once its eager softmax runs in fp64.
FP32_TOLERANCE = 1e-5
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # every special token inside the vocabulary
_LAYOUT = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    **_IDS,
}
# transformers' default experts implementation, grouped_mm, has no fp64 kernel on the CPU; "eager" loops over the
# experts (the "-batched_mm" entry runs the other fp64-capable implementation).
_EXPERTS = "eager"
_LAYOUT_3 = {**_LAYOUT, "num_hidden_layers": 3}
_MOE = {"output_router_logits": True, "router_aux_loss_coef": 0.25, "num_experts_per_tok": 2}
_ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]


@dataclass(frozen=True)
class CatalogModel:
    """One tiny model of the catalog.

    Attributes:
        name: the catalog key (``model_type`` and a variant suffix).
        model_class: the transformers class built (a ``*ForCausalLM``, or Gemma 3's multimodal class).
        config: builds the model's config.
        traits: what the entry switches on, for reports.
        moe: whether the model has mixture-of-experts layers and returns a router ``aux_loss``.
        fp32_softmax: whether its attention (transformers' eager function of the family) rounds the attention
            probabilities through fp32 (``softmax(..., dtype=torch.float32)``), so that in fp64 it agrees with
            exact attention only to fp32 rounding.
        fp32_norms: whether its norms compute in fp32 up to and with their weight (Gemma's ``(1 + w)`` on
            ``x.float()``, Cohere's LayerNorm), so that a norm weight's gradient is an fp32 sum over tokens and
            its outputs carry fp32 rounding.
    """

    name: str
    model_class: str
    config: Callable[[], PretrainedConfig]
    traits: str
    moe: bool = False
    fp32_softmax: bool = False
    fp32_norms: bool = False

    def fp32_rounded(self, recompute: str) -> bool:
        """Whether, patched with ``recompute``, its gradients equal the unpatched model's only to fp32 rounding
        (``FP32_TOLERANCE``): its norms compute in fp32 (chunks re-associate their sums), or its softmax is
        rounded through fp32 and memo's attention core computes attention in fp64."""
        return self.fp32_norms or (self.fp32_softmax and recompute == "memo")

    @property
    def model_type(self) -> str:
        """The ``config.model_type`` of the model."""
        return self.config().model_type

    @property
    def layers(self) -> int:
        """The number of decoder layers."""
        return self.config().get_text_config().num_hidden_layers

    def build(self) -> PreTrainedModel:
        """The model, its weights drawn from the current torch seed."""
        return getattr(transformers, self.model_class)(self.config())


def _config(
    config_cls: str, attn: str | None = None, experts: str | None = None, **fields: Any
) -> Callable[[], PretrainedConfig]:
    """A builder of ``transformers.<config_cls>(**fields)`` with the attention implementation ``attn`` and the
    experts implementation ``experts`` where given (else the ones transformers picks for a model built from it)."""

    def build() -> PretrainedConfig:
        config = getattr(transformers, config_cls)(**fields)
        if attn is not None:
            config._attn_implementation = attn
        if experts is not None:
            config._experts_implementation = experts
        return config

    return build


def _gemma3_multimodal() -> PretrainedConfig:
    """Gemma 3's multimodal config: the text model of ``gemma3_text`` beside a one-layer SigLIP tower."""
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    return transformers.Gemma3Config(
        text_config=_GEMMA3_TEXT().to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )


def _with_attention(config: PretrainedConfig, attn: str) -> PretrainedConfig:
    """``config`` set to the attention implementation ``attn``."""
    config._attn_implementation = attn
    return config


_GEMMA3_TEXT = _config(
    "Gemma3TextConfig",
    **_LAYOUT_3,
    head_dim=8,
    sliding_window=WINDOW,
    layer_types=_ALTERNATING,
    query_pre_attn_scalar=16,
    final_logit_softcapping=2.0,
)

_ENTRIES = [
    CatalogModel(
        "llama",
        "LlamaForCausalLM",
        _config("LlamaConfig", **_LAYOUT),
        "control: a family hf_memo supported before",
    ),
    CatalogModel(
        "mistral-window",
        "MistralForCausalLM",
        _config("MistralConfig", **_LAYOUT, sliding_window=WINDOW),
        f"sliding_window={WINDOW} on every layer",
    ),
    CatalogModel(
        "mistral-window-eager",
        "MistralForCausalLM",
        _config("MistralConfig", "eager", **_LAYOUT, sliding_window=WINDOW),
        f"sliding_window={WINDOW}, eager attention",
        fp32_softmax=True,
    ),
    CatalogModel(
        "ministral",
        "MinistralForCausalLM",
        _config("MinistralConfig", **_LAYOUT_3, head_dim=8, sliding_window=WINDOW, layer_types=_ALTERNATING),
        f"sliding({WINDOW})/full/sliding layers",
    ),
    CatalogModel(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        _config(
            "Qwen3MoeConfig",
            experts=_EXPERTS,
            **_LAYOUT,
            **_MOE,
            head_dim=8,
            num_experts=4,
            moe_intermediate_size=16,
            norm_topk_prob=True,
        ),
        "MoE (4 experts, top-2, normalised top-k weights) on every layer, q/k norms, router loss",
        moe=True,
    ),
    CatalogModel(
        "qwen3_moe-mixed",
        "Qwen3MoeForCausalLM",
        _config(
            "Qwen3MoeConfig",
            experts=_EXPERTS,
            **_LAYOUT_3,
            **_MOE,
            head_dim=8,
            num_experts=4,
            moe_intermediate_size=16,
            mlp_only_layers=[1],
        ),
        "a dense layer 1 between MoE layers 0 and 2 (mlp_only_layers), router loss",
        moe=True,
    ),
    CatalogModel(
        "mixtral",
        "MixtralForCausalLM",
        _config("MixtralConfig", experts=_EXPERTS, **_LAYOUT, **_MOE, num_local_experts=4, sliding_window=WINDOW),
        f"MoE (4 experts, top-2), sliding_window={WINDOW}, router loss",
        moe=True,
    ),
    CatalogModel(
        "mixtral-batched_mm",
        "MixtralForCausalLM",
        _config("MixtralConfig", experts="batched_mm", **_LAYOUT, **_MOE, num_local_experts=4, sliding_window=WINDOW),
        "as mixtral, with transformers' batched_mm experts implementation",
        moe=True,
    ),
    CatalogModel(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        _config(
            "Qwen2MoeConfig",
            experts=_EXPERTS,
            **_LAYOUT_3,
            **_MOE,
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
        ),
        "MoE with a gated shared expert, qkv biases, a dense layer 1 (mlp_only_layers), router loss",
        moe=True,
    ),
    CatalogModel(
        "olmoe",
        "OlmoeForCausalLM",
        _config("OlmoeConfig", experts=_EXPERTS, **_LAYOUT, **_MOE, num_experts=4, clip_qkv=0.05),
        "MoE (4 experts, top-2), q/k norms over all heads, a clip_qkv that clips, router loss",
        moe=True,
    ),
    CatalogModel(
        "gpt_oss",
        "GptOssForCausalLM",
        _config(
            "GptOssConfig",
            experts=_EXPERTS,
            **_LAYOUT,
            **_MOE,
            head_dim=8,
            num_local_experts=4,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
                "rope_theta": 150000.0,
            },
        ),
        f"attention sinks, sliding({WINDOW})/full layers, YaRN RoPE, clamped SwiGLU MoE with biases, router loss, "
        "eager attention (its only non-kernel one; its softmax stays in fp64)",
        moe=True,
    ),
    CatalogModel(
        "gemma",
        "GemmaForCausalLM",
        _config("GemmaConfig", **_LAYOUT, head_dim=8),
        "scaled embeddings, (1 + w) RMSNorm, GeLU-tanh MLP",
        fp32_norms=True,
    ),
    CatalogModel(
        "gemma2",
        "Gemma2ForCausalLM",
        _config(
            "Gemma2Config",
            **_LAYOUT_3,
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=_ALTERNATING,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=0.05,
            final_logit_softcapping=2.0,
        ),
        f"attention and final logit soft-capping (both change the logits), sliding({WINDOW})/full layers, "
        "sandwich norms, query_pre_attn_scalar, eager attention (it has no sdpa)",
        fp32_softmax=True,
        fp32_norms=True,
    ),
    CatalogModel(
        "gemma3_text",
        "Gemma3ForCausalLM",
        _GEMMA3_TEXT,
        f"sliding({WINDOW})/full layers with their own RoPE bases, q/k norms, final logit soft-capping "
        "(transformers ignores Gemma 3's attn_logit_softcapping)",
        fp32_norms=True,
    ),
    CatalogModel(
        "gemma3_text-eager",
        "Gemma3ForCausalLM",
        lambda: _with_attention(_GEMMA3_TEXT(), "eager"),
        "as gemma3_text, eager attention",
        fp32_softmax=True,
        fp32_norms=True,
    ),
    CatalogModel(
        "gemma3",
        "Gemma3ForConditionalGeneration",
        _gemma3_multimodal,
        "Gemma 3's multimodal class trained on text only (a tiny SigLIP tower it never runs), gemma3_text's traits",
        fp32_norms=True,
    ),
    CatalogModel(
        "phi3",
        "Phi3ForCausalLM",
        _config(
            "Phi3Config",
            **_LAYOUT,
            sliding_window=WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
        f"fused qkv_proj and gate_up_proj, partial rotary 0.5, sliding_window={WINDOW}",
    ),
    CatalogModel(
        "glm4",
        "Glm4ForCausalLM",
        _config("Glm4Config", **_LAYOUT, head_dim=8),
        "sandwich norms (post-attention and post-MLP), interleaved partial rotary 0.5, fused gate_up_proj, qkv biases",
    ),
    CatalogModel(
        "olmo2",
        "Olmo2ForCausalLM",
        _config("Olmo2Config", **_LAYOUT),
        "post-norm (no input_layernorm), q/k norms over all heads",
    ),
    CatalogModel(
        "olmo3",
        "Olmo3ForCausalLM",
        _config("Olmo3Config", **_LAYOUT_3, sliding_window=WINDOW, layer_types=_ALTERNATING),
        f"post-norm, q/k norms over all heads, sliding({WINDOW})/full layers",
    ),
    CatalogModel(
        "granite",
        "GraniteForCausalLM",
        _config(
            "GraniteConfig",
            **_LAYOUT,
            embedding_multiplier=6.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
            logits_scaling=4.0,
            mlp_bias=True,
        ),
        "embedding, residual and attention multipliers, logits_scaling, MLP biases",
    ),
    CatalogModel(
        "cohere",
        "CohereForCausalLM",
        _config("CohereConfig", **_LAYOUT, logit_scale=0.5),
        "parallel attention and MLP from one LayerNorm, interleaved RoPE, logit_scale",
        fp32_norms=True,
    ),
    CatalogModel(
        "cohere-qk_norm",
        "CohereForCausalLM",
        _config("CohereConfig", **_LAYOUT, logit_scale=0.5, use_qk_norm=True),
        "as cohere, with per-head q/k LayerNorms (use_qk_norm)",
        fp32_norms=True,
    ),
    CatalogModel(
        "cohere2",
        "Cohere2ForCausalLM",
        _config(
            "Cohere2Config",
            **_LAYOUT_3,
            head_dim=8,
            logit_scale=0.5,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
        f"sliding({WINDOW}) RoPE layers and a NoPE full layer, parallel attention and MLP, logit_scale",
        fp32_norms=True,
    ),
    CatalogModel(
        "smollm3",
        "SmolLM3ForCausalLM",
        _config("SmolLM3Config", **_LAYOUT_3, no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=WINDOW),
        f"a NoPE layer (no_rope_layers), which SmolLM3 makes a sliding({WINDOW}) layer",
    ),
    CatalogModel(
        "starcoder2",
        "Starcoder2ForCausalLM",
        _config("Starcoder2Config", **_LAYOUT, sliding_window=WINDOW, residual_dropout=0.0, embedding_dropout=0.0),
        f"LayerNorm, biases everywhere, GeLU c_fc/c_proj MLP, sliding_window={WINDOW}, dropouts 0",
    ),
    CatalogModel(
        "exaone4",
        "Exaone4ForCausalLM",
        _config(
            "Exaone4Config",
            **_LAYOUT_3,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
        f"post-norm, q/k norms, sliding({WINDOW}) RoPE layers and a NoPE full layer",
    ),
]

CATALOG: dict[str, CatalogModel] = {entry.name: entry for entry in _ENTRIES}
CATALOG_NAMES = list(CATALOG)


def build_catalog_model(name: str, seed: int = 0) -> PreTrainedModel:
    """The catalog model ``name`` in fp64 and train mode, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return CATALOG[name].build().to(torch.float64).train()
