from hf_memo.integrations.cli import main
from hf_memo.integrations.demo import markov_tokens


def test_demo_trains_both_models_to_the_same_losses_and_reports_memory(capsys):
    assert main(["demo", "--steps", "3", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "largest per-step difference from plain HF" in out
    drift = float(out.split("largest per-step difference from plain HF")[1].split()[0])
    assert drift < 1e-4
    rows = [line for line in out.splitlines() if line.strip().startswith(("64 |", "16,384 |", "65,536 |"))]
    assert len(rows) == 3
    ratio_at_64k = float(rows[-1].rsplit("|", 1)[1].strip().rstrip("x"))
    assert ratio_at_64k > 3


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--steps", "0"]) == 2
    assert "hf-memo demo: error: --steps must be >= 1" in capsys.readouterr().err


def test_markov_tokens_are_deterministic_and_in_vocabulary():
    a = markov_tokens(1000, 50, 4, seed=3)
    assert a.shape == (4, 50) and a.min() >= 0 and a.max() < 1000
    assert a.equal(markov_tokens(1000, 50, 4, seed=3))
    assert len(a.unique()) <= 256
