import pytest
import torch

import hf_memo
from hf_memo.patches import (
    FAMILIES,
    apply_hf_memo_to_gpt2,
    apply_hf_memo_to_llama,
    apply_hf_memo_to_mistral,
    apply_hf_memo_to_qwen2,
    apply_hf_memo_to_qwen3,
    uninstall_from_class,
)
from tests.conftest import assert_same_grads, build_model, make_batch

INSTALLERS = {
    "gpt2": apply_hf_memo_to_gpt2,
    "llama": apply_hf_memo_to_llama,
    "mistral": apply_hf_memo_to_mistral,
    "qwen2": apply_hf_memo_to_qwen2,
    "qwen3": apply_hf_memo_to_qwen3,
}


@pytest.fixture
def installed(family):
    yield family
    uninstall_from_class(FAMILIES[family])


def test_every_family_has_a_class_installer():
    assert sorted(INSTALLERS) == sorted(FAMILIES)


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
    uninstall_from_class(FAMILIES[installed])
    assert hf_memo.applied_config(build_model(installed)) is None
    uninstall_from_class(FAMILIES[installed])  # a second uninstall is harmless


def test_installing_again_changes_the_config_of_later_models(installed):
    INSTALLERS[installed](mlp_chunks=2)
    INSTALLERS[installed](mlp_chunks=5)
    assert hf_memo.applied_config(build_model(installed)).mlp_chunks == 5
