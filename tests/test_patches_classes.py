import os
import sys

import pytest
import torch

import hf_memo
from hf_memo.patches import (
    apply_hf_memo_to_gpt2,
    apply_hf_memo_to_llama,
    apply_hf_memo_to_mistral,
    apply_hf_memo_to_qwen2,
    apply_hf_memo_to_qwen3,
    install_on_class,
    uninstall_from_class,
)
from tests.conftest import FAMILIES, ROOT, assert_same_grads, build_model, make_batch, run_command

INSTALLERS = {
    "gpt2": apply_hf_memo_to_gpt2,
    "llama": apply_hf_memo_to_llama,
    "mistral": apply_hf_memo_to_mistral,
    "qwen2": apply_hf_memo_to_qwen2,
    "qwen3": apply_hf_memo_to_qwen3,
}


def _class_of(family):
    return type(build_model(family))


@pytest.fixture
def installed(family):
    yield family
    uninstall_from_class(_class_of(family))


def test_every_family_has_a_class_installer():
    assert sorted(INSTALLERS) == sorted(FAMILIES)


RELOADED = """
import importlib
import hf_memo
from hf_memo.patches import apply_hf_memo_to_llama, uninstall_from_class
from tests.conftest import build_model
from transformers.models.llama import modeling_llama

config = build_model("llama").config
importlib.reload(modeling_llama)
model = modeling_llama.LlamaForCausalLM(config)
hf_memo.apply(model, mlp_chunks=3)
assert hf_memo.applied_config(model).mlp_chunks == 3
apply_hf_memo_to_llama(mlp_chunks=2)
assert hf_memo.applied_config(modeling_llama.LlamaForCausalLM(config)).mlp_chunks == 2
uninstall_from_class(modeling_llama.LlamaForCausalLM)
"""


def test_installers_patch_the_class_a_reloaded_modeling_module_defines():
    """After ``importlib.reload`` (IPython's autoreload), models are recognised by structure, not by the class
    object hf_memo saw first, and the named installer patches the class the module defines now (in a process of
    its own: the reload would leave this one with two Llama classes)."""
    run_command([sys.executable, "-c", RELOADED], env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_install_on_class_refuses_what_is_not_a_model_class():
    with pytest.raises(TypeError, match="transformers model class"):
        install_on_class(build_model("llama"))


def test_models_built_after_install_are_patched_and_exact(installed, tmp_path):
    reference = build_model(installed)
    INSTALLERS[installed](mlp_chunks=3, lm_head_chunks=2)
    model = build_model(installed)
    assert hf_memo.applied_config(model).mlp_chunks == 3
    reference.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.float64).train()
    assert hf_memo.applied_config(loaded).lm_head_chunks == 2
    ids, labels = make_batch(2, 11)
    for m in (loaded, reference):
        m(input_ids=ids, labels=labels).loss.backward()
    assert_same_grads(loaded, reference)


def test_uninstall_stops_patching_new_models(installed):
    INSTALLERS[installed]()
    uninstall_from_class(_class_of(installed))
    assert hf_memo.applied_config(build_model(installed)) is None
    uninstall_from_class(_class_of(installed))  # a second uninstall is harmless


def test_installing_again_changes_the_config_of_later_models(installed):
    INSTALLERS[installed](mlp_chunks=2)
    INSTALLERS[installed](mlp_chunks=5)
    assert hf_memo.applied_config(build_model(installed)).mlp_chunks == 5
