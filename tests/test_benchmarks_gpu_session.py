"""benchmarks/gpu_session/memo_truth.py on the CPU: its measure path runs on a tiny Llama (--dry-run, no CUDA
statistics), and what it compares the GPU with is the estimator's own model."""

import importlib.util
import json
import sys

import torch

from tests.conftest import ROOT, run_command

SCRIPT = ROOT / "benchmarks" / "gpu_session" / "memo_truth.py"


def memo_truth():
    spec = importlib.util.spec_from_file_location("memo_truth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_modelled_flash_backward_workspace_is_the_documented_llama_3_8b_figure():
    workspace = memo_truth().modelled_workspace(32_768, 32, 8, 128, torch.bfloat16)
    # kernel_workspace's docstring: 32,896 bytes per token for Llama-3-8B's grouped-query flash backward
    assert workspace["cuda-flash"]["peak_bytes"] == workspace["flash-attn"]["peak_bytes"] == 32_768 * 32_896


def test_comparison_is_within_five_percent_of_the_measured_bytes():
    module = memo_truth()
    near = module.compare_policy({"device_peak": 100}, {"steps": [{"max_memory_allocated": 104}]})
    far = module.compare_policy({"device_peak": 100}, {"steps": [{"max_memory_allocated": 110}]})
    unknown = module.compare_policy(None, {"steps": [{"max_memory_allocated": None}]})
    assert near["within_5_percent"] and near["ratio_allocated_to_predicted"] == 1.04
    assert far["within_5_percent"] is False
    assert unknown["within_5_percent"] is None and unknown["ratio_allocated_to_predicted"] is None


def test_measure_dry_run_runs_each_policy_on_the_cpu_and_writes_its_table(tmp_path):
    kinds = ["X+attn/host", "X/device"]
    run_command([sys.executable, str(SCRIPT), "measure", "--dry-run", "--steps", "1", "--out", str(tmp_path),
                 "--kinds", *kinds])  # fmt: skip
    data = json.loads((tmp_path / "memo_truth.json").read_text())
    assert list(data["policies"]) == kinds
    for kind, entry in data["policies"].items():
        assert entry["predicted"]["device_peak"] > 0
        assert entry["measured"]["runtime_policy"] == f"4 {kind}"  # the runtime ran exactly the policy predicted
        assert entry["comparison"]["max_memory_allocated"] is None  # no CUDA statistics on the CPU
    assert set(data["flash_backward_workspace"]) == {"256", "512"}
    for entry in data["flash_backward_workspace"].values():
        assert entry["measured"]["core_backend"] == "cpu-flash"
        assert entry["modelled"]["cuda-flash"]["peak_bytes"] > 0
    assert "X+attn/host" in (tmp_path / "memo_truth.md").read_text()
