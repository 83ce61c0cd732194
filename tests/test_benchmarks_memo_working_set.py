"""benchmarks/memo_working_set.py still runs (tiny shapes): both policies on both kernel targets, with the tensors
alive at the worst moment."""

from tests.conftest import run_benchmark


def test_memo_working_set_benchmark_reports_the_worst_moment_of_each_policy_and_target(tmp_path):
    results = run_benchmark("memo_working_set", tmp_path)
    assert set(results["rows"]) == {"X only", "X + attention"}
    for row in results["rows"].values():
        assert set(row) == {"cpu", "cuda"}
        for target, worst in row.items():
            assert worst["beyond_U"] > 0 and worst["phase"] and worst["alive"]
            assert (worst["kernel_workspace_U"] > 0) == (target == "cuda")  # only CUDA kernels hold a workspace
    assert "largest kernel workspace" in (tmp_path / "memo_working_set.md").read_text()
