"""benchmarks/transformers_suite: the plugin patches the models tests build, reports are read and compared."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from transformers import (
    Gemma3ForConditionalGeneration,
    GPT2LMHeadModel,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaModel,
    OPTConfig,
    OPTForCausalLM,
)

import hf_memo
from benchmarks.transformers_suite import plugin
from benchmarks.transformers_suite.__main__ import main
from benchmarks.transformers_suite.compare import ALLOWED, REGRESSION, categorise, differences
from benchmarks.transformers_suite.junit import Outcome, read_outcomes, read_seconds
from hf_memo.patches import supported_model_types
from tests.conftest import FAMILY_BUILDERS
from tests.model_catalog import CATALOG

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_ok" time="0.1"/>
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_sub" time="0.1"/>
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_sub" time="0.1">
  <failure message="AssertionError: 1 != 2&#10;second line">trace</failure></testcase>
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_skip" time="0.0">
  <skipped message="needs a GPU"/></testcase>
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_err" time="0.0">
  <error message="">ValueError: bad setup</error></testcase>
<testcase classname="tests.models.llama.test_modeling_llama.LlamaModelTest" name="test_subtests" time="0.5">
  <failure message="ValueError: one">trace</failure><failure message="KeyError: two">trace</failure></testcase>
</testsuite><testsuite name="pytest" time="1.25"/></testsuites>
"""
PREFIX = "tests/models/llama/test_modeling_llama.py::LlamaModelTest::"


def test_read_outcomes_keeps_the_worst_outcome_every_failure_and_first_message_lines(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(JUNIT)
    outcomes = read_outcomes(report)
    assert outcomes == {
        PREFIX + "test_ok": Outcome("passed"),
        PREFIX + "test_sub": Outcome("failed", "AssertionError: 1 != 2", ("AssertionError: 1 != 2",)),
        PREFIX + "test_skip": Outcome("skipped", "needs a GPU"),
        PREFIX + "test_err": Outcome("error", "ValueError: bad setup", ("ValueError: bad setup",)),
        PREFIX + "test_subtests": Outcome("failed", "ValueError: one", ("ValueError: one", "KeyError: two")),
    }
    assert read_seconds(report) == 1.25


@pytest.mark.parametrize(
    ("message", "trace", "category"),
    [
        ("ValueError: MemoConfig.recompute='full' cannot be combined with Hugging Face gradient checkpointing (",
         "", "hf-checkpointing"),
        ("ValueError: recompute='memo' runs causal self-attention over whole sequences; it got", "", "needs-issue-14"),
        ("ValueError: recompute='memo' computes attention without dropout; set", "", "memo-attention-dropout"),
        ("AttributeError: 'NoneType' object has no attribute 'shape'", ">  x = out.logits.shape\nE  Attr",
         "logits-by-design"),
        ("AttributeError: 'NoneType' object has no attribute 'backward'", ">  loss.backward()", REGRESSION),
        ("AssertionError: Tensor-likes are not close!", "", REGRESSION),
    ],
)  # fmt: skip
def test_categorise_sorts_failure_messages(message, trace, category):
    assert categorise(message, trace) == category


def test_differences_lists_only_tests_passing_stock():
    stock = {"a": Outcome("passed"), "b": Outcome("failed", "x"), "c": Outcome("passed"), "d": Outcome("passed")}
    patched = {"a": Outcome("passed"), "b": Outcome("failed", "y"), "c": Outcome("skipped", "why")}
    found = differences(stock, patched, "memo", "class")
    assert [(d.test, d.status, d.message) for d in found] == [
        ("c", "skipped", "why"),
        ("d", "error", "not run (test missing from the report)"),
    ]
    assert {(d.mode, d.level) for d in found} == {("memo", "class")}


def test_differences_lists_new_failures_of_tests_already_failing_stock():
    dropout = "ValueError: recompute='memo' computes attention without dropout; x"
    stock = {"t": Outcome("failed", "KeyError: a", ("KeyError: a",))}
    patched = {"t": Outcome("failed", dropout, (dropout, "KeyError: a"))}
    found = differences(stock, patched, "memo", "instance")
    assert [(d.status, d.category) for d in found] == [("new-failure", "memo-attention-dropout")]
    assert differences(stock, stock, "memo", "instance") == []


@pytest.mark.parametrize("level", plugin.LEVELS)
def test_install_patches_new_causal_lms_only_and_uninstall_stops_it(level):
    plugin.install("selective", level, chunks=2, offload_fraction=0.25)
    try:
        built = [FAMILY_BUILDERS[name]() for name in ("llama", "gpt2")]
        built += [CATALOG[name].build() for name in ("qwen3_moe", "cohere2")]  # no fixed list of classes
        backbone = LlamaModel(LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                          num_attention_heads=2))  # fmt: skip
        configs = [hf_memo.applied_config(model) for model in built]
        assert configs == [plugin.memo_config("selective", 2, 0.25)] * 4
        assert configs[0].mlp_chunks == configs[0].lm_head_chunks == 2
        assert not hasattr(backbone, "_hf_memo_patch")
        plugin.COUNT.settle()
        assert plugin.COUNT.line().startswith("hf_memo patched ")
    finally:
        plugin.uninstall()
    assert hf_memo.applied_config(FAMILY_BUILDERS["llama"]()) is None
    assert hf_memo.applied_config(CATALOG["qwen3_moe"].build()) is None


def test_class_level_covers_the_causal_lm_of_every_proven_model_type():
    classes = plugin.class_level_classes()
    assert len(classes) == len(supported_model_types())
    assert {GPT2LMHeadModel, Gemma3ForConditionalGeneration, GptOssForCausalLM} <= set(classes)


def test_a_causal_lm_hf_memo_refuses_runs_stock_and_is_counted(monkeypatch):
    count = plugin.PatchCount()
    monkeypatch.setattr(plugin, "COUNT", count)
    plugin.install("memo", "instance", chunks=2, offload_fraction=0.5)
    try:
        model = OPTForCausalLM(OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                         num_attention_heads=2, word_embed_proj_dim=16))  # fmt: skip
        FAMILY_BUILDERS["qwen2"]()
    finally:
        plugin.uninstall()
    assert hf_memo.applied_config(model) is None
    count.settle()
    assert count.line().startswith("hf_memo patched 1 of 1 supported causal LMs built; refused 1x: hf_memo cannot ")
    assert "OPTForCausalLM" in count.line()


def test_stock_patches_nothing():
    plugin.install("stock", "instance", chunks=2, offload_fraction=0.5)
    try:
        assert hf_memo.applied_config(FAMILY_BUILDERS["qwen2"]()) is None
    finally:
        plugin.uninstall()


# A stand-in for a transformers model test file: passes stock, fails once hf_memo patches the model.
FAKE_MODEL_TEST = """
import hf_memo
from hf_memo.patches import supported_model_types
from tests.conftest import FAMILY_BUILDERS
from tests.model_catalog import CATALOG


def test_builds_an_unpatched_model():
    assert hf_memo.applied_config(FAMILY_BUILDERS["llama"]()) is None


def test_always_passes():
    FAMILY_BUILDERS["llama"]()
"""


def test_runner_reports_a_test_that_passes_stock_but_not_under_hf_memo(tmp_path: Path):
    root = tmp_path / "transformers"
    test_file = root / "tests" / "models" / "llama" / "test_modeling_llama.py"
    test_file.parent.mkdir(parents=True)
    test_file.write_text(textwrap.dedent(FAKE_MODEL_TEST))
    (root / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "out"
    main(["--transformers-root", str(root), "--families", "llama", "--modes", "memo", "--levels", "class"]
         + ["--out", str(out)])  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["mode"], r["counts"]["passed"], r["models"]) for r in summary["runs"]] == [
        ("stock", 2, [0, 2]),
        ("memo", 1, [2, 2]),
    ]
    assert [(d["test"].rsplit("::", 1)[-1], d["category"]) for d in summary["differences"]] == [
        ("test_builds_an_unpatched_model", REGRESSION)
    ]
    assert "test_builds_an_unpatched_model" in (out / "summary.md").read_text()


@pytest.mark.skipif(
    not os.environ.get("HF_MEMO_TRANSFORMERS_ROOT"),
    reason="set HF_MEMO_TRANSFORMERS_ROOT to a transformers checkout at the installed version to run its model tests",
)
def test_transformers_llama_training_tests_pass_under_every_mode(tmp_path: Path):
    """Opt-in smoke run of transformers' own llama training tests: every difference from stock is an allowed one."""
    out = tmp_path / "out"
    main(["--transformers-root", os.environ["HF_MEMO_TRANSFORMERS_ROOT"], "--families", "llama", "--levels", "instance"]
         + ["-k", "training", "--out", str(out)])  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert all(run["models"][0] == run["models"][1] > 0 for run in summary["runs"] if run["mode"] != "stock")
    unexplained = [d for d in summary["differences"] if d["category"] not in ALLOWED]
    assert unexplained == []
