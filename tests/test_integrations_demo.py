import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hf_memo.data import LONGALPACA_SAMPLE, LONGALPACA_TOKENIZER
from hf_memo.integrations.cli import main
from hf_memo.integrations.demo import packed_rows
from hf_memo.planner.plan import MemoryPlan

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "longalpaca" / "train.py"


def test_demo_trains_both_to_the_same_losses_and_compares_peak_memory(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "3", "--seq-len", "256", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fine-tuned on CPU for 3 steps on 56 packed rows of 256 tokens from sample.json" in printed
    for step in (1, 2, 3):
        assert re.search(rf"step +{step}/3  loss [\d.]+ .* tokens/s  alpha 0\.50", printed)  # hf_memo's run
        assert re.search(rf"step +{step}/3  loss [\d.]+  \(hf_memo [\d.]+, difference", printed)  # plain HF's run
    losses = re.search(r"Loss ([\d.]+) -> ([\d.]+); largest per-step difference .* plain HF ([\d.e+-]+)", printed)
    assert float(losses[2]) < float(losses[1]) and float(losses[3]) < 1e-5
    rows = re.findall(r"^ +([\d,]+) \| .* \| ([\d.]+)x$", printed, flags=re.MULTILINE)
    assert [length for length, _ in rows] == ["256", "1,024", "4,096"]
    ratios = [float(ratio) for _, ratio in rows]
    assert ratios[0] > 1 and ratios == sorted(ratios) and ratios[-1] > 2  # hf_memo needs less, more so when longer
    plan = MemoryPlan.load(out / "hf_memo_plan.json")
    assert (plan.meta["batch_size"], plan.meta["seq_len"]) == (1, 256)
    assert f"Memory plan (planned): {out / 'hf_memo_plan.json'}" in printed
    assert (
        out / "memory_timeline.png"
    ).stat().st_size > 10_000 and f"Memory plot: {out / 'memory_timeline.png'}" in printed
    assert torch.get_num_threads() > 0


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    assert main(["demo", "--steps", "0"]) == 2
    assert "hf-memo demo: error: --steps and --threads must be >= 1" in capsys.readouterr().err
    assert main(["demo", "--data", str(tmp_path / "missing.json")]) == 2
    assert f"missing.json does not exist (the shipped sample is {LONGALPACA_SAMPLE.parent})" in capsys.readouterr().err


def test_demo_rows_are_the_recipes_llama2_records_concatenated():
    spec = importlib.util.spec_from_file_location("longalpaca_train", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe
    spec.loader.exec_module(recipe)
    tokenizer = AutoTokenizer.from_pretrained(LONGALPACA_TOKENIZER)
    records = json.loads(LONGALPACA_SAMPLE.read_text())
    input_ids, labels = packed_rows(records, tokenizer, 2048)
    fmt = recipe.prompt_format("llama2")
    encoded = [recipe.encode_record(r["instruction"], r["output"], tokenizer, fmt, 10**6) for r in records]
    stream = {key: [t for e in encoded for t in e[key]] for key in ("input_ids", "labels")}
    assert input_ids.flatten().tolist() == stream["input_ids"][: input_ids.numel()]
    assert labels.flatten().tolist() == stream["labels"][: labels.numel()]
    assert len(input_ids) >= 20  # the demo's 20 steps at 2,048 tokens see every row once
    assert ((labels[:, 1:] != -100).sum(1) > 0).all()


def test_packed_rows_need_enough_tokens():
    tokenizer = AutoTokenizer.from_pretrained(LONGALPACA_TOKENIZER)
    with pytest.raises(ValueError, match="fewer than --seq-len 100000"):
        packed_rows([{"instruction": "a", "output": "b"}], tokenizer, 100_000)
