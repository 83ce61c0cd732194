import pytest
import torch
from transformers import BertConfig, LlamaConfig, T5Config

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
    ],
)
def test_builtin_shapes_have_the_published_sizes(name, billions, layers):
    config = builtin_config(name.upper())
    model, _ = fake_causal_lm(config, torch.bfloat16)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
    assert config.num_hidden_layers == layers


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
