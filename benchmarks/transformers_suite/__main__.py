"""Run transformers' own model test files stock and under every hf_memo mode, and report the differences.

    python -m benchmarks.transformers_suite --transformers-root /path/to/transformers \\
        [--families llama gpt2] [--modes none memo] [--levels instance class] [-k EXPR] [--out DIR]

``--transformers-root`` is a checkout of the transformers repository at the installed version's tag
(``tests/models/<family>/test_modeling_<family>.py`` and the common test files beside them). Each family
runs once stock, then once per (mode, level); the JUnit reports, a JSON summary and a markdown table of
the tests that pass stock but not under hf_memo are written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import transformers

from benchmarks.transformers_suite.compare import CATEGORIES, LOGITS_BY_DESIGN, REGRESSION, Difference, differences
from benchmarks.transformers_suite.junit import STATUSES, Outcome, read_outcomes, read_seconds
from benchmarks.transformers_suite.plugin import LEVELS, MODES

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")  # the default sweep
# Families hf_memo supports since it finds a model's structure (hf_memo.patches.structure): mixture-of-experts,
# sliding-window / hybrid-layer, soft-capped, scaled and norm-layout variants (gemma3 covers Gemma3ForCausalLM and
# the multimodal Gemma3ForConditionalGeneration on text). Run them with --families.
NEW_FAMILIES = (
    "qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "gemma", "gemma2", "gemma3", "phi3", "glm4", "olmo2",
    "olmo3", "granite", "cohere", "cohere2", "smollm3", "starcoder2", "ministral", "exaone4",
)  # fmt: skip


def pytest_command(family: str, mode: str, level: str, report: Path, args: argparse.Namespace) -> list[str]:
    """The pytest command line of one run (executed in ``--transformers-root``)."""
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
        "-p", "benchmarks.transformers_suite.plugin", f"--hf-memo-mode={mode}", f"--hf-memo-level={level}",
        f"--hf-memo-chunks={args.chunks}", f"--hf-memo-offload-fraction={args.offload_fraction}",
        f"--junitxml={report}", f"--timeout={args.timeout}", "--tb=short",
        f"tests/models/{family}/test_modeling_{family}.py",
    ]  # fmt: skip
    return command + (["-k", args.k] if args.k else [])


PATCHED = re.compile(rb"hf_memo patched (\d+) of (\d+) supported causal LMs built")


def run_pytest(family: str, mode: str, level: str, args: argparse.Namespace) -> dict:
    """Run one family under one (mode, level): outcomes by test id, test seconds, (patched, built) models.

    With ``--reuse``, a run whose report and log are already in ``--out`` is read instead of run again.
    """
    name = f"{family}-{mode}" if mode == "stock" else f"{family}-{mode}-{level}"
    report, log = args.out / "junit" / f"{name}.xml", args.out / "logs" / f"{name}.log"
    if not (args.reuse and report.exists() and log.exists()):
        report.parent.mkdir(parents=True, exist_ok=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        report.unlink(missing_ok=True)
        done = subprocess.run(
            pytest_command(family, mode, level, report, args), cwd=args.transformers_root, env=env, capture_output=True
        )
        log.write_bytes(done.stdout + done.stderr)
        if not report.exists():
            raise RuntimeError(f"pytest wrote no report for {name} (exit {done.returncode}); see {log}")
    patched = PATCHED.search(log.read_bytes())
    models = [int(patched.group(1)), int(patched.group(2))] if patched else None
    seconds = read_seconds(report)
    print(f"{name}: tests took {seconds:.0f} s, patched/built models {models}", flush=True)
    return dict(outcomes=read_outcomes(report), seconds=seconds, models=models)


def counts(outcomes: dict[str, Outcome]) -> dict[str, int]:
    return {status: sum(o.status == status for o in outcomes.values()) for status in STATUSES}


def markdown(summary: dict) -> str:
    """The summary as a markdown report: runs with counts and times, then every difference."""
    lines = [
        f"# transformers {summary['transformers']} model tests under hf_memo",
        "",
        f"Settings: mlp_chunks = lm_head_chunks = {summary['chunks']}, memo offload_fraction = "
        f"{summary['offload_fraction']}, -k {summary['k'] or '(all)'}.",
        "",
        *([f"Test files: {summary['source']}", ""] if summary.get("source") else []),
        "| family | mode | level | passed | skipped | failed | error | test seconds | causal LMs patched / built "
        "| differences from stock |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in summary["runs"]:
        c = run["counts"]
        diff = "" if run["mode"] == "stock" else str(run["differences"])
        lines.append(
            f"| {run['family']} | {run['mode']} | {run['level']} | {c['passed']} | {c['skipped']} | {c['failed']} "
            f"| {c['error']} | {run['seconds']:.0f} | {'/'.join(map(str, run['models'] or ['?']))} | {diff} |"
        )
    lines += ["", "## Tests that pass stock but not under hf_memo", ""]
    grouped: dict[str, dict[str, dict]] = {}  # category -> test -> first message and the (mode, level) runs
    for item in summary["differences"]:
        entry = grouped.setdefault(item["category"], {}).setdefault(item["test"], dict(message=item["message"]))
        entry.setdefault("runs", []).append(f"{item['mode']}/{item['level']}")
    if not grouped:
        lines.append("None.")
    descriptions = {name: text for name, (text, _) in CATEGORIES.items()} | {
        LOGITS_BY_DESIGN: "reads `logits` of a training forward with labels, which hf_memo returns as None by design",
        REGRESSION: "not explained: a defect",
    }
    for category, tests in sorted(grouped.items()):
        lines += [f"### {category}: {descriptions[category]}", ""]
        lines += ["| test | mode/level | first error line (first run) |", "|---|---|---|"]
        for test, entry in tests.items():
            message = entry["message"].replace("|", "\\|")[:200]
            lines.append(f"| `{test}` | {', '.join(entry['runs'])} | {message} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transformers-root", type=Path, required=True)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES + NEW_FAMILIES)
    parser.add_argument("--modes", nargs="+", default=[m for m in MODES if m != "stock"], choices=MODES[1:])
    parser.add_argument("--levels", nargs="+", default=list(LEVELS), choices=LEVELS)
    parser.add_argument("-k", default="", help="pytest -k expression selecting tests (default: all)")
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--offload-fraction", type=float, default=0.5)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--out", type=Path, default=Path("transformers_suite_out"))
    parser.add_argument("--reuse", action="store_true", help="read runs whose report is already in --out")
    parser.add_argument("--source", default="", help="where the test files came from (written into the report)")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # pytest runs in --transformers-root
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = dict(
        transformers=transformers.__version__,
        chunks=args.chunks,
        offload_fraction=args.offload_fraction,
        k=args.k,
        source=args.source,
        runs=[],
        differences=[],
    )
    for family in args.families:
        stock = run_pytest(family, "stock", LEVELS[0], args)  # the level means nothing stock
        summary["runs"].append(
            dict(family=family, mode="stock", level="-", counts=counts(stock["outcomes"]), seconds=stock["seconds"])
            | dict(models=stock["models"])
        )
        for mode in args.modes:
            for level in args.levels:
                run = run_pytest(family, mode, level, args)
                found: list[Difference] = differences(stock["outcomes"], run["outcomes"], mode, level)
                summary["runs"].append(
                    dict(family=family, mode=mode, level=level, counts=counts(run["outcomes"]), seconds=run["seconds"])
                    | dict(models=run["models"], differences=len(found))
                )
                summary["differences"] += [d.to_dict() for d in found]
                (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
                (args.out / "summary.md").write_text(markdown(summary))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "summary.md").write_text(markdown(summary))
    print(f"wrote {args.out}/summary.md and summary.json")


if __name__ == "__main__":
    main()
