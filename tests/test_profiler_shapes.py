import pytest
import torch
from transformers import BertConfig, LlamaConfig, T5Config

import hf_memo
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.shapes import SHAPE_NAMES, builtin_config, load_config


@pytest.mark.parametrize(
    "name,billions,layers",
    [
        ("gpt-7b", 6.74, 32),
        ("gpt-13b", 13.02, 40),
        ("gpt-30b", 32.53, 60),
        ("gpt-65b", 65.29, 80),
        ("llama-2-7b", 6.74, 32),
        ("llama-2-13b", 13.02, 40),
        ("llama-3-8b", 8.03, 32),
        ("mistral-7b", 7.24, 32),
        ("qwen2.5-7b", 7.62, 28),
        ("qwen3-8b", 8.19, 36),
        ("gemma-2-9b", 9.24, 42),
        ("phi-3-mini", 3.82, 32),
        ("mixtral-8x7b", 46.70, 32),
        ("qwen3-30b-a3b", 30.53, 48),
        ("gpt-oss-20b", 20.91, 24),
    ],
)
def test_builtin_shapes_have_the_published_sizes(name, billions, layers):
    config = builtin_config(name.upper())
    model, _ = fake_causal_lm(config, torch.bfloat16)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
    assert config.num_hidden_layers == layers
    hf_memo.apply(model, recompute="memo")  # the estimator profiles it patched: its structure is recognised
    assert hf_memo.applied_config(model).recompute == "memo"


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'llama-9b'") as error:
        load_config("llama-9b")
    assert all(name in str(error.value) for name in SHAPE_NAMES)


def test_config_files_and_folders_load(tmp_path):
    LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4).save_pretrained(tmp_path)
    for source in (tmp_path, tmp_path / "config.json"):
        config = load_config(str(source))
        assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 3, 64)


@pytest.mark.parametrize(
    "content,message",
    [
        (BertConfig().to_json_string(), "not a decoder-only causal LM"),
        (T5Config().to_json_string(), "not a decoder-only causal LM"),
        ('{"hidden_size": 4}', "no model_type"),
        ('{"model_type": "no-such-family"}', "model_type Transformers does not know"),
        ("{not json", "cannot read"),
    ],
)
def test_bad_config_files_are_refused_with_the_reason(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_config(str(path))
    with pytest.raises(ValueError, match="no such config file"):
        load_config(str(tmp_path / "missing.json"))


def test_a_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_config(str(tmp_path))


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in ``tmp_path``, offline (``HF_HUB_OFFLINE=1``, as huggingface_hub reads it)."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_a_hub_id_loads_from_the_local_cache_through_transformers(offline_hub_cache):
    snapshot = offline_hub_cache / "models--some-org--tiny-llama" / "snapshots" / "0123abcd"
    LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4).save_pretrained(snapshot)
    (offline_hub_cache / "models--some-org--tiny-llama" / "refs").mkdir()
    (offline_hub_cache / "models--some-org--tiny-llama" / "refs" / "main").write_text("0123abcd")
    config = load_config("some-org/tiny-llama")
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 3, 64)


def test_a_hub_id_not_in_the_cache_says_what_to_do(offline_hub_cache):
    with pytest.raises(ValueError) as error:
        load_config("meta-llama/Meta-Llama-3-8B")
    message = str(error.value)
    assert message.startswith("meta-llama/Meta-Llama-3-8B is not a file here, nor a model in the local Hugging Face")
    assert str(offline_hub_cache) in message and "HF_HUB_OFFLINE is set, so the Hub was not asked" in message
    assert "hf download meta-llama/Meta-Llama-3-8B config.json" in message and "\n" not in message
