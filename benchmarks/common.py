"""What the benchmark scripts share: the ``--out`` option, their results folder, the tiny Llama of smoke runs, and
scripts run in a fresh Python process."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import LlamaConfig

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def fresh_process_json(script: str, *args: str) -> dict:
    """Run ``script`` (Python source) with ``args`` in a new Python process at the repository root; the JSON object
    its last line of output prints."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_out_option(parser: argparse.ArgumentParser, device: str = "cpu") -> None:
    """Add ``--out``: the folder results go to (default ``benchmarks/results/<date>-<device>``)."""
    parser.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default benchmarks/results/<date>-{device})"
    )


def results_folder(out: Path | None, device: str = "cpu") -> tuple[str, Path]:
    """Today's date (ISO) and the folder results go to: ``out``, else ``benchmarks/results/<date>-<device>``.

    The folder is created.
    """
    date = datetime.date.today().isoformat()
    folder = out or RESULTS / f"{date}-{device}"
    folder.mkdir(parents=True, exist_ok=True)
    return date, folder


def tiny_llama(layers: int, heads: int = 4) -> LlamaConfig:
    """A Llama small enough for seconds-long smoke runs: hidden 64, ``heads`` query heads, 2 KV heads, 64K positions."""
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=224,
        num_attention_heads=heads,
        num_key_value_heads=2,
        vocab_size=2000,
        num_hidden_layers=layers,
        max_position_embeddings=1 << 16,
    )
