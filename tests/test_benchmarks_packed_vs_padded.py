"""The packed-vs-padded benchmark still runs (tiny shapes); its real results live under benchmarks/results/."""

from tests.conftest import run_benchmark


def test_packed_vs_padded_benchmark_runs_and_counts_less_attention_per_sample(tmp_path):
    results = run_benchmark("packed_vs_padded", tmp_path)
    pairs = results["attention_pairs"]
    assert pairs["per_sample"] < pairs["padded_rows"] and pairs["per_sample"] < pairs["whole_row_causal"]
    assert sum(results["lengths"]) == 2048 and max(results["lengths"]) == 512
    assert set(results["modes"]) == {"transformers (unpatched)", "none", "full", "selective", "memo alpha=0.5"}
    assert all(row["packed_step_s"] > 0 and row["padded_peak_gib"] > 0 for row in results["modes"].values())
    assert "Attention (query, key) pairs" in (tmp_path / "packed_vs_padded.md").read_text()
