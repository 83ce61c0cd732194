"""The planner benchmark still runs, on synthetic traces and on trace files (tiny shapes, seconds)."""

import json
import sys

from tests.conftest import ROOT, run_command

SCRIPT = ROOT / "benchmarks" / "planner_dsa.py"


def test_planner_benchmark_runs_on_synthetic_traces_and_on_trace_files(tmp_path):
    traces = tmp_path / "traces"
    run = [sys.executable, str(SCRIPT), "--mip-limit", "1"]
    run_command(run + ["--tiny", "--save-traces", str(traces), "--out", str(tmp_path)])
    results = json.loads((tmp_path / "planner_dsa.json").read_text())
    assert set(results["runs"]) == {"tiny-llama S=512", "tiny-llama S=512 ckpt"}
    for run_result in results["runs"].values():
        layer = run_result["layer_traces"][0]
        assert layer["layers"] == [0, 1, 2, 3]  # identical layers are solved once
        assert layer["planner"]["ratio"] <= layer["greedy"]["ratio"]
        assert layer["cpsat_alone"]["found"] and layer["mip_alone"]["seconds"] > 0
        assert run_result["plan"]["peak"] >= run_result["plan"]["lower_bound"]
        assert run_result["caching_allocator"]["peak_reserved"] >= run_result["caching_allocator"]["peak_requested"]
    assert "| tiny-llama S=512 ckpt |" in (tmp_path / "planner_dsa.md").read_text()

    saved = sorted(traces.glob("*.jsonl"))
    assert len(saved) == 2
    command = [sys.executable, str(SCRIPT), "--mip-limit", "0", "--trace", str(saved[0]), "--out", str(tmp_path)]
    run_command(command)
    from_file = json.loads((tmp_path / "planner_dsa_traces.json").read_text())
    assert saved[0].stem == "tiny-llama_S512"
    assert from_file["runs"]["tiny-llama_S512"]["plan"]["peak"] == results["runs"]["tiny-llama S=512"]["plan"]["peak"]
    assert "irregular" not in from_file


def test_planner_benchmark_profiles_whole_steps_and_compares_the_allocator_with_the_arena(tmp_path):
    from tests.test_profiler_step import CONFIGS

    CONFIGS["llama"](5).save_pretrained(tmp_path)
    config = str(tmp_path / "config.json")
    command = [sys.executable, str(SCRIPT), "--profile", config, "--seq-lens", "64", "--modes", "hf-checkpointing"]
    command += [
        "memo",
        "--mip-limit",
        "0",
        "--alignment",
        "4KiB",
        "--out",
        str(tmp_path),
        "--save-traces",
        str(tmp_path),
    ]
    run_command(command)
    results = json.loads((tmp_path / "planner_dsa_profiled_align4KiB.json").read_text())
    assert set(results["runs"]) == {f"{config} S=64 hf-checkpointing", f"{config} S=64 memo"}
    assert results["alignment"] == 4096
    memo = results["runs"][f"{config} S=64 memo"]
    assert memo["profile_seconds"] > 0 and memo["plan"]["arena_size"] > 0
    assert memo["plan"]["peak_over_512_lower_bound"] >= memo["plan"]["ratio"] >= 1  # 4 KiB rounding costs bytes
    allocator = memo["caching_allocator"]
    assert allocator["with_arena"]["peak_requested"] >= allocator["peak_requested"] - memo["plan"]["arena_size"]
    assert allocator["plan_peak_over_requested"] == memo["plan"]["peak"] / allocator["peak_requested"]
    assert len(list(tmp_path.glob("*.jsonl"))) == 2
