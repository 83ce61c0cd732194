"""Cold wall time of the documented ``hf-memo estimate`` questions, each alone in a fresh process.

Each question runs as ``python -m hf_memo.integrations.cli estimate ...`` (imports included, no cache: nothing is
cached between runs), once as users run it (profiles side by side, one worker per usable CPU) and once with
``--jobs 1`` (one after the other), back to back so both see the same machine. Besides the wall time, the CPU
time of the process and its workers is recorded, and before each question the wall time of the imports alone
(``import hf_memo.integrations.estimate``): on a shared machine all of them move together with whatever else
runs, and the imports show how fast the machine was at that moment. Writes ``estimate_speed.{json,md}`` and
each question's printed table.

    python benchmarks/estimate_speed.py                  # writes benchmarks/results/<date>-cpu/
    python benchmarks/estimate_speed.py --only 8gpu      # one question
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def timed(command: list[str]) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (the process and every child it waited for) and stdout of ``command``."""
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=ENV, check=True)
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return wall, cpu, done.stdout


def question(flags: str, jobs: int | None) -> tuple[float, float, str]:
    """One question in a fresh process (``jobs``: the ``--jobs`` flag, ``None`` for the default)."""
    extra = [] if jobs is None else ["--jobs", str(jobs)]
    return timed([sys.executable, "-m", "hf_memo.integrations.cli", "estimate", *flags.split(), *extra])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(QUESTIONS), default=None, help="one question")
    add_out_option(parser)
    args = parser.parse_args()
    _, out = results_folder(args.out)
    names = [args.only] if args.only else list(QUESTIONS)
    rows = []
    for name in names:
        imports, _, _ = timed([sys.executable, "-c", "import hf_memo.integrations.estimate"])
        load = os.getloadavg()[0]
        seconds, cpu, table = question(QUESTIONS[name], None)
        one_seconds, one_cpu, one_table = question(QUESTIONS[name], 1)
        if one_table != table:
            raise RuntimeError(f"{name}: --jobs 1 printed another answer than the default")
        (out / f"estimate_{name}.txt").write_text(f"$ hf-memo estimate {QUESTIONS[name]}\n{table}")
        rows.append(
            {
                "question": name,
                "flags": QUESTIONS[name],
                "seconds": seconds,
                "cpu_seconds": cpu,
                "one_worker_seconds": one_seconds,
                "one_worker_cpu_seconds": one_cpu,
                "imports_seconds": imports,
                "load_before": load,
            }
        )
        print(f"{name}: {seconds:.1f} s ({one_seconds:.1f} s with one worker, imports {imports:.1f} s)", flush=True)
    record = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "questions": rows}
    (out / "estimate_speed.json").write_text(json.dumps(record, indent=2))
    lines = [
        f"Cold wall time of `hf-memo estimate` questions, each alone in a fresh process ({record['machine']}, "
        "shared with other machines' jobs: times move with them; the imports alone, timed right before each "
        "question, show how fast the machine was then). Default: profiles side by side, one worker per CPU; "
        "`--jobs 1`: one after the other, run right after. CPU time includes the workers'. Both print the same table.",
        "",
        "| question | flags | wall time | CPU time | wall, `--jobs 1` | CPU, `--jobs 1` | imports alone "
        "| load before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['question']} | `{r['flags']}` | {r['seconds']:.1f} s | {r['cpu_seconds']:.1f} s | "
        f"{r['one_worker_seconds']:.1f} s | {r['one_worker_cpu_seconds']:.1f} s | {r['imports_seconds']:.1f} s | "
        f"{r['load_before']:.2f} |"
        for r in rows
    ]
    (out / "estimate_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
