"""The sequence-parallel benchmark still runs (tiny shapes); its real results live under benchmarks/results/."""

from tests.conftest import run_benchmark


def test_sequence_parallel_benchmark_measures_the_exchange_and_shrinking_activations(tmp_path):
    results = run_benchmark("sequence_parallel", tmp_path)
    assert (tmp_path / "sequence_parallel.md").read_text().startswith("Per-GPU memory")
    for mode, runs in results["runs"].items():
        activations = [runs[sp]["peak"]["activations"] for sp in ("1", "2", "4", "8")]
        assert activations == sorted(activations, reverse=True) and activations[-1] < activations[0] / 2
        for sp in ("2", "4", "8"):
            forward, backward = runs[sp]["all_to_all_forward"], runs[sp]["all_to_all_backward"]
            recomputed = 2 if "checkpointing" in mode else 1  # checkpointing exchanges again for the recompute
            assert forward["calls_per_layer"] == 4 and backward["calls_per_layer"] == 4 * recomputed
            assert forward["buffer_bytes_per_layer"] == runs[sp]["expected_buffer_bytes_per_layer"]
            assert backward["buffer_bytes_per_layer"] == recomputed * runs[sp]["expected_buffer_bytes_per_layer"]
        assert runs["1"]["all_to_all_forward"]["calls_per_layer"] == 0
