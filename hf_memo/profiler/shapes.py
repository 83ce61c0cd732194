"""Built-in model shapes (Transformers configs, no weights) and loading a model's ``config.json`` (a file, a folder or
a Hugging Face Hub model id).

``gpt-7b`` ... ``gpt-65b`` are the decoder shapes the MEMO paper evaluates (7B/13B/30B/65B GPT models),
written as Llama-architecture configs with the LLaMA-1 sizes of those parameter counts (layers,
hidden size, heads, MLP width, 32000-token vocabulary). ``llama-2-7b``, ``llama-2-13b`` and
``llama-3-8b`` are those models' published configs, as are the shapes of other families people fine-tune on long
contexts (Mistral, Qwen 2.5 and 3, Gemma 2, Phi-3, and the mixtures of experts Mixtral, Qwen3-MoE and gpt-oss).
Any other model: its ``config.json`` or Hub id.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Transformers loads when a config is built or read, not when the shapes' names are
    from transformers import LlamaConfig, PretrainedConfig


class _ConfigMapping:
    """Transformers' ``CONFIG_MAPPING`` (model type -> config class), imported on first use."""

    def __getitem__(self, model_type: str) -> Any:
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[model_type]

    def __contains__(self, model_type: object) -> bool:
        from transformers import CONFIG_MAPPING

        return model_type in CONFIG_MAPPING


CONFIG_MAPPING = _ConfigMapping()


def _llama(
    layers: int, hidden: int, heads: int, intermediate: int, kv_heads: int | None = None, **extra: object
) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        intermediate_size=intermediate,
        vocab_size=extra.pop("vocab_size", 32000),
        max_position_embeddings=extra.pop("max_position_embeddings", 2048),
        rms_norm_eps=extra.pop("rms_norm_eps", 1e-6),
        tie_word_embeddings=False,
        **extra,
    )


_SHAPES = {
    "gpt-7b": lambda: _llama(32, 4096, 32, 11008),
    "gpt-13b": lambda: _llama(40, 5120, 40, 13824),
    "gpt-30b": lambda: _llama(60, 6656, 52, 17920),
    "gpt-65b": lambda: _llama(80, 8192, 64, 22016),
    "llama-2-7b": lambda: _llama(32, 4096, 32, 11008, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama-2-13b": lambda: _llama(40, 5120, 40, 13824, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama-3-8b": lambda: _llama(
        32,
        4096,
        32,
        14336,
        kv_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    "mistral-7b": lambda: CONFIG_MAPPING["mistral"](
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen2.5-7b": lambda: CONFIG_MAPPING["qwen2"](
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "qwen3-8b": lambda: CONFIG_MAPPING["qwen3"](
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "gemma-2-9b": lambda: CONFIG_MAPPING["gemma2"](
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
    ),
    "phi-3-mini": lambda: CONFIG_MAPPING["phi3"](
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, pad_token_id=32000,
        tie_word_embeddings=False,
    ),
    "mixtral-8x7b": lambda: CONFIG_MAPPING["mixtral"](
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": lambda: CONFIG_MAPPING["qwen3_moe"](
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    "gpt-oss-20b": lambda: CONFIG_MAPPING["gpt_oss"](
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        max_position_embeddings=131072, sliding_window=128, tie_word_embeddings=False,
    ),
}  # fmt: skip
SHAPE_NAMES = tuple(_SHAPES)


def builtin_config(name: str) -> PretrainedConfig:
    """The config of built-in shape ``name`` (case-insensitive); ``ValueError`` lists the known names."""
    factory = _SHAPES.get(name.lower())
    if factory is None:
        known = ", ".join(SHAPE_NAMES)
        raise ValueError(
            f"unknown model {name!r}; built-in models are {known} (or give a path to a config.json, or a Hugging "
            "Face Hub id such as meta-llama/Meta-Llama-3-8B)"
        )
    return factory()


def check_decoder_lm(config: PretrainedConfig, source: str) -> PretrainedConfig:
    """``config`` if it describes a decoder-only causal LM, else ``ValueError`` naming ``source``."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or config.is_encoder_decoder or encoder:
        raise ValueError(f"{source} is not a decoder-only causal LM config (model_type {model_type!r})")
    return config


# A Hub model id, "owner/name" (a path to a file that does not exist ends in .json and is not one).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load_config(name_or_path: str) -> PretrainedConfig:
    """A built-in shape by name, the config in a ``config.json`` file (or a folder holding one), or a Hugging Face
    Hub model's config by its id (``"meta-llama/Meta-Llama-3-8B"``, see :func:`hub_config`)."""
    path = Path(name_or_path)
    if path.exists():
        return _file_config(path)
    if _HUB_ID.match(name_or_path) and path.suffix != ".json":
        return hub_config(name_or_path)
    if path.suffix == ".json" or "/" in name_or_path:
        raise ValueError(f"no such config file: {name_or_path}")
    return builtin_config(name_or_path)


def _file_config(path: Path) -> PretrainedConfig:
    """The config in the ``config.json`` file ``path`` (or the folder ``path`` holding one)."""
    from transformers import AutoConfig

    file = path / "config.json" if path.is_dir() else path
    try:
        record = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {file} as JSON ({error})") from None
    if not isinstance(record, dict) or "model_type" not in record:
        raise ValueError(f"{file} is not a Transformers config (no model_type)")
    if record["model_type"] not in CONFIG_MAPPING:
        raise ValueError(f"{file} has a model_type Transformers does not know: {record['model_type']!r}")
    try:
        config = AutoConfig.for_model(**record)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{file} is not a valid {record['model_type']} config ({error})") from None
    return check_decoder_lm(config, str(file))


def hub_config(repo_id: str) -> PretrainedConfig:
    """The config of the Hub model ``repo_id``, loaded by Transformers from the local Hugging Face cache
    (``HF_HUB_CACHE``) or, when it is not there, from the Hub unless offline (``HF_HUB_OFFLINE=1``).

    ``ValueError`` when neither has it, saying how to get it; or when Transformers cannot read it.
    """
    try:
        config = _cached_or_downloaded(repo_id)
    except OSError as error:
        raise ValueError(_unavailable(repo_id, error)) from None
    except ValueError as error:  # an unknown model_type, remote code, ...
        raise ValueError(f"Transformers cannot read the config of {repo_id}: {_first_line(error)}") from None
    return check_decoder_lm(config, repo_id)


def _cached_or_downloaded(repo_id: str) -> PretrainedConfig:
    import huggingface_hub
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(repo_id, local_files_only=True)
    except OSError:
        if huggingface_hub.is_offline_mode():
            raise
    return AutoConfig.from_pretrained(repo_id)


def _unavailable(repo_id: str, error: OSError) -> str:
    """Why the config of ``repo_id`` could not be had, and what to do, in one line."""
    import huggingface_hub

    cache = huggingface_hub.constants.HF_HUB_CACHE
    where = f"{repo_id} is not a file here, nor a model in the local Hugging Face cache ({cache})"
    if huggingface_hub.is_offline_mode():
        why = "and HF_HUB_OFFLINE is set, so the Hub was not asked"
    else:
        why = f"and the Hub did not give its config ({_first_line(error)})"
    return (
        f"{where}, {why}: download it where the Hub can be reached (hf download {repo_id} config.json; a gated "
        "model needs `hf auth login` and its terms accepted) or give the path of its config.json"
    )


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
