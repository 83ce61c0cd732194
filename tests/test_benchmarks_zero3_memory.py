"""benchmarks/zero3_memory.py: the on-paper per-rank memory of Llama-3-8B at 128K under ZeRO-3."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
zero3_memory = pytest.importorskip("zero3_memory")


def test_llama3_8b_counts_and_the_per_rank_budget_add_up():
    counts = zero3_memory.parameter_counts(zero3_memory.LLAMA3_8B)
    assert counts["model"] == 8_030_261_248  # Llama-3-8B
    assert counts["layer"] == 218_112_000
    per_token = zero3_memory.saved_per_token(zero3_memory.LLAMA3_8B)
    assert (per_token["layer_input"], per_token["memo_kept"]) == (8 * 1024, 16 * 1024)  # DESIGN.md: 8 and 16 KiB
    for sp in (1, 8):
        rows = zero3_memory.per_rank(zero3_memory.LLAMA3_8B, sp)
        memo, checkpointing = rows["zero3+hf_memo"], rows["zero3+hf_checkpointing"]
        assert memo["parameter_partitions"] == checkpointing["parameter_partitions"]
        assert memo["activations_kept_host"] == 16 * 32 * (131072 // sp) / 2**20  # 16 KiB per token and layer
        assert memo["device_total"] < checkpointing["device_total"] / 2


def test_the_script_writes_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["zero3_memory.py", "--out", str(tmp_path)])
    zero3_memory.main()
    assert (tmp_path / "zero3_memory.json").exists() and "sp=8" in (tmp_path / "zero3_memory.md").read_text()
