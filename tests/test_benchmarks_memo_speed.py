"""benchmarks/memo_speed.py still runs (tiny shapes): every contender at every length, timed, and losses agreeing."""

from tests.conftest import run_benchmark

CONTENDERS = {"hf-checkpointing", "memo X+attn", "memo X only", "memo alpha 0.5"}


def test_memo_speed_benchmark_times_every_contender_and_their_losses_agree(tmp_path):
    results = run_benchmark("memo_speed", tmp_path)
    assert set(results["lengths"]) == {"128", "256"}
    assert results["threads"] == 1 and results["torch"] and results["cpu_count"] >= 1
    for rows in results["lengths"].values():
        assert set(rows) == CONTENDERS
        assert rows["hf-checkpointing"]["ratio_to_hf_checkpointing"] == 1.0
        for row in rows.values():
            assert len(row["step_s"]) == results["repeats"] and all(t > 0 for t in row["step_s"])
            assert 0 < row["fastest_s"] <= row["median_s"] and row["tokens_per_s"] > 0
            assert row["ratio_to_hf_checkpointing"] > 0
            assert row["max_abs_loss_diff"] < 1e-4  # float32, same weights and batch
            assert row["forward_per_layer"] >= 1 and row["backward_per_layer"] >= 1  # attention ran, was counted
        for name in CONTENDERS - {"hf-checkpointing"}:
            assert rows[name]["memo_attention_calls"] >= 1
        assert rows["hf-checkpointing"]["memo_attention_calls"] is None
    table = (tmp_path / "memo_speed.md").read_text()
    assert all(name in table for name in CONTENDERS)
