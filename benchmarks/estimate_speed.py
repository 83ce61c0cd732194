"""Wall time of the documented ``hf-memo estimate`` questions, each in a fresh process, as a user meets them.

Each question runs as ``python -m hf_memo.integrations.cli estimate ... --json`` (imports included) three ways:

- **first ask**: an empty cache folder (``$HF_MEMO_CACHE_DIR``), so the answer comes from the fits that ship with
  hf_memo where they match this code and these libraries (``hf_memo/estimator/shipped_fits/``), else from profiles;
- **asked again**: the same folder, right after;
- **profiled** (``--profiled``; minutes each): ``--no-cache``, every fit profiled, as a model or setup nobody
  asked before is; its answer must equal the first ask's, which checks the shipped fits against the code.

Besides wall time, the CPU time of the process and its workers is recorded, and before each question the wall time
of the imports alone (``import hf_memo.integrations.estimate``): on a shared machine all of them move together with
whatever else runs. Writes ``estimate_speed.{json,md}`` and each question's printed table.

    python benchmarks/estimate_speed.py                      # writes benchmarks/results/<date>-cpu/
    python benchmarks/estimate_speed.py --only 8gpu --profiled
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, add_out_option, results_folder

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


def timed(command: list[str], cache: Path) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (the process and every child it waited for) and stdout of ``command``, with its
    estimator cache in ``cache``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_MEMO_CACHE_DIR": str(cache)}
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return wall, cpu, done.stdout


def ask(flags: str, modes: str, cache: Path, *extra: str) -> tuple[float, float, dict]:
    """One question in a fresh process: wall and CPU seconds and its JSON answer."""
    command = [sys.executable, "-m", "hf_memo.integrations.cli", "estimate", *flags.split(), "--modes", modes]
    wall, cpu, out = timed([*command, "--json", *extra], cache)
    return wall, cpu, json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(QUESTIONS), default=None, help="one question")
    parser.add_argument("--modes", default="hf,hf-checkpointing,full,memo", help="--modes of every question")
    parser.add_argument("--profiled", action="store_true", help="also ask with --no-cache (every fit profiled)")
    add_out_option(parser)
    args = parser.parse_args()
    _, out = results_folder(args.out)
    names = [args.only] if args.only else list(QUESTIONS)
    rows = []
    for name in names:
        flags = QUESTIONS[name]
        with tempfile.TemporaryDirectory(prefix="estimate_speed_") as folder:
            imports, _, _ = timed([sys.executable, "-c", "import hf_memo.integrations.estimate"], Path(folder))
            row = {"question": name, "flags": flags, "imports_seconds": imports, "load_before": os.getloadavg()[0]}
            row["first_seconds"], row["first_cpu_seconds"], first = ask(flags, args.modes, Path(folder))
            row["again_seconds"], row["again_cpu_seconds"], again = ask(flags, args.modes, Path(folder))
            row["fits_written_by_first_ask"] = len(list(Path(folder).rglob("*.pkl.xz")))
            if again != first:
                raise RuntimeError(f"{name}: asked again, another answer than the first ask")
            if args.profiled:
                row["profiled_seconds"], row["profiled_cpu_seconds"], profiled = ask(
                    flags, args.modes, Path(folder), "--no-cache"
                )
                if profiled != first:
                    raise RuntimeError(f"{name}: every fit profiled gives another answer than the first ask")
            command = [sys.executable, "-m", "hf_memo.integrations.cli", "estimate", *flags.split()]
            _, _, table = timed([*command, "--modes", args.modes], Path(folder))  # the printed table, from the cache
        (out / f"estimate_{name}.txt").write_text(f"$ hf-memo estimate {flags} --modes {args.modes}\n{table}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    record = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "modes": args.modes, "questions": rows}
    (out / "estimate_speed.json").write_text(json.dumps(record, indent=2))
    lines = [
        f"Wall time of `hf-memo estimate` questions, each in a fresh process ({record['machine']}; modes "
        f"`{args.modes}`). First ask: an empty cache folder (the shipped fits read where they match); asked again: "
        "the same folder; profiled: `--no-cache`, every fit profiled (its answer equal to the first ask's, whole "
        "JSON). CPU time includes the workers'. The imports alone, timed right before each question, show how fast "
        "the machine was then.",
        "",
        "| question | flags | first ask: wall / CPU | fits it wrote | asked again: wall / CPU "
        "| profiled: wall / CPU | imports alone | load before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        profiled = (
            f"{r['profiled_seconds']:.1f} s / {r['profiled_cpu_seconds']:.1f} s" if "profiled_seconds" in r else "-"
        )
        lines.append(
            f"| {r['question']} | `{r['flags']}` | {r['first_seconds']:.1f} s / {r['first_cpu_seconds']:.1f} s | "
            f"{r['fits_written_by_first_ask']} | {r['again_seconds']:.1f} s / {r['again_cpu_seconds']:.1f} s | "
            f"{profiled} | {r['imports_seconds']:.1f} s | {r['load_before']:.2f} |"
        )
    (out / "estimate_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
