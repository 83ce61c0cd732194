"""The benchmark scripts still run (tiny shapes, seconds); their real results live under benchmarks/results/."""

from tests.conftest import run_benchmark


def test_minseq_memory_benchmark_runs_and_writes_its_results(tmp_path):
    results = run_benchmark("minseq_memory", tmp_path)
    assert set(results["step_peak"]) == {"2048", "4096"}
    assert results["ratios_at_longest"]["lm_head_loss_hf_over_hf_memo"] > 1
    assert (tmp_path / "minseq_memory.png").stat().st_size > 0


def test_estimate_table_benchmark_runs_and_writes_its_results(tmp_path):
    results = run_benchmark("estimate_table", tmp_path)
    longest = {mode: row["longest_seq_len"] for mode, row in results["modes"].items()}
    assert 0 < longest["hf"] <= longest["hf-checkpointing"] <= longest["full"]
    assert all(row["relative_difference"] < 0.02 for row in results["extrapolation_check"]["modes"].values())
    assert "MsT paper" in (tmp_path / "estimate_table.md").read_text()
    assert (tmp_path / "estimate_timeline.png").stat().st_size > 0


def test_memo_residency_benchmark_runs_and_memo_keeps_less_on_the_device(tmp_path):
    modes = run_benchmark("memo_residency", tmp_path)["modes"]
    memo, hf = modes["memo alpha=0"], modes["hf+checkpointing"]
    assert memo["device_activations"] < hf["device_activations"]
    assert memo["host_activations"] > 0 == hf["host_activations"]
