"""Built-in model shapes (Transformers configs, no weights) and loading a model's ``config.json``.

``gpt-7b`` ... ``gpt-65b`` are the decoder shapes the MEMO paper evaluates (7B/13B/30B/65B GPT models),
written as Llama-architecture configs with the LLaMA-1 sizes of those parameter counts (layers,
hidden size, heads, MLP width, 32000-token vocabulary). ``llama-2-7b``, ``llama-2-13b`` and
``llama-3-8b`` are those models' published configs.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import CONFIG_MAPPING, AutoConfig, LlamaConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES


def _llama(
    layers: int, hidden: int, heads: int, intermediate: int, kv_heads: int | None = None, **extra: object
) -> LlamaConfig:
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
}
SHAPE_NAMES = tuple(_SHAPES)


def builtin_config(name: str) -> PretrainedConfig:
    """The config of built-in shape ``name`` (case-insensitive); ``ValueError`` lists the known names."""
    factory = _SHAPES.get(name.lower())
    if factory is None:
        known = ", ".join(SHAPE_NAMES)
        raise ValueError(f"unknown model {name!r}; built-in models are {known} (or give a path to a config.json)")
    return factory()


def check_decoder_lm(config: PretrainedConfig, source: str) -> PretrainedConfig:
    """``config`` if it describes a decoder-only causal LM, else ``ValueError`` naming ``source``."""
    model_type = getattr(config, "model_type", None)
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or config.is_encoder_decoder or encoder:
        raise ValueError(f"{source} is not a decoder-only causal LM config (model_type {model_type!r})")
    return config


def load_config(name_or_path: str) -> PretrainedConfig:
    """A built-in shape by name, or the config in a ``config.json`` file (or a folder holding one)."""
    path = Path(name_or_path)
    if not path.exists():
        if path.suffix == ".json" or "/" in name_or_path:
            raise ValueError(f"no such config file: {name_or_path}")
        return builtin_config(name_or_path)
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
