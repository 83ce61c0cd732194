"""Cold wall time of the documented ``hf-memo estimate`` questions, each alone in a fresh process.

Each question runs as ``python -m hf_memo.integrations.cli estimate ...`` (imports included, no cache: nothing is
cached between runs). The machine's load average is recorded before and after each run: on a shared machine the
times are inflated by whatever else runs. Writes ``estimate_speed.{json,md}`` and each question's printed table.

    python benchmarks/estimate_speed.py                  # writes benchmarks/results/<date>-cpu/
    python benchmarks/estimate_speed.py --only 8gpu      # one question
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from common import add_out_option, results_folder

QUESTIONS = {
    "80gib_128k": "--model llama-3-8b --gpu-memory 80GiB --seq-len 128k",
    "80gib_128k_host128": "--model llama-3-8b --gpu-memory 80GiB --seq-len 128k --host-memory 128GiB",
    "139gib_128gib_lora": "--model llama-3-8b --gpu-memory 139GiB --host-memory 128GiB --trainable lora",
    "1gpu_80gib_1tib_offload": "--model llama-3-8b --gpu-memory 80GiB --host-memory 1TiB --zero 2 --offload-optimizer",
    "8gpu": (
        "--model llama-3-8b --gpu-memory 80GiB --host-memory 1TiB --num-gpus 8 --sequence-parallel 8 --zero 3 "
        "--offload-optimizer --seq-len 1M"
    ),
}
ROOT = Path(__file__).resolve().parent.parent


def run(flags: str) -> tuple[float, str, tuple[float, float, float], tuple[float, float, float]]:
    """Wall seconds, printed table, load averages before and after one question in a fresh process."""
    before = os.getloadavg()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hf_memo.integrations.cli", "estimate", *flags.split()],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    return time.perf_counter() - start, done.stdout, before, os.getloadavg()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(QUESTIONS), default=None, help="one question")
    add_out_option(parser)
    args = parser.parse_args()
    _, out = results_folder(args.out)
    names = [args.only] if args.only else list(QUESTIONS)
    rows = []
    for name in names:
        seconds, table, before, after = run(QUESTIONS[name])
        (out / f"estimate_{name}.txt").write_text(f"$ hf-memo estimate {QUESTIONS[name]}\n{table}")
        rows.append(
            {"question": name, "flags": QUESTIONS[name], "seconds": seconds, "load_before": before, "load_after": after}
        )
        print(f"{name}: {seconds:.1f} s (load {before[0]:.2f} -> {after[0]:.2f})", flush=True)
    record = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "questions": rows}
    (out / "estimate_speed.json").write_text(json.dumps(record, indent=2))
    lines = [
        f"Cold wall time of `hf-memo estimate` questions, each alone in a fresh process ({record['machine']}, "
        "shared: the 1-minute load average before and after each run is shown; a load above the core count "
        "means other jobs competed for the CPUs).",
        "",
        "| question | flags | wall time | load before / after |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['question']} | `{r['flags']}` | {r['seconds']:.1f} s | {r['load_before'][0]:.2f} / "
        f"{r['load_after'][0]:.2f} |"
        for r in rows
    ]
    (out / "estimate_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
