"""Command line of the benchmark suite: ``python -m benchmarks.suite {list,run,report}``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

from benchmarks.suite.contenders import CONTENDERS, unavailable_reason
from benchmarks.suite.metrics import device_slug
from benchmarks.suite.report import write_report
from benchmarks.suite.runner import ROOT, detect_device, run_suite
from benchmarks.suite.store import ResultStore
from benchmarks.suite.suites import SUITES, Suite, suite
from benchmarks.suite.workloads import WORKLOADS


def _selection(kind: str, asked: list[str] | None, available: tuple[str, ...], suite_name: str) -> list[str]:
    if not asked:
        return list(available)
    unknown = [name for name in asked if name not in available]
    if unknown:
        raise ValueError(
            f"--{kind} {', '.join(unknown)} is not in suite {suite_name}; its {kind}s: {', '.join(available)}"
        )
    return asked


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _list() -> None:
    print("suites:")
    for item in SUITES.values():
        print(
            f"  {item.name}: {item.description} ({len(item.workloads)} workloads x {len(item.contenders)} contenders)"
        )
    print("workloads:")
    for item in WORKLOADS.values():
        print(f"  {item.name}: {item.description}")
    print("contenders (availability here, GPU run / dry run):")
    for item in CONTENDERS.values():
        gpu, dry = unavailable_reason(item, dry_run=False), unavailable_reason(item, dry_run=True)
        print(f"  {item.name}: {item.description}")
        print(f"      GPU: {gpu or 'runs'}; dry run: {dry or 'runs'}")


def _run(args: argparse.Namespace) -> None:
    chosen = suite(args.suite)
    workloads = _selection("workload", args.workload, chosen.workloads, chosen.name)
    contenders = _selection("contender", args.contender, chosen.contenders, chosen.name)
    device = detect_device(args.dry_run, args.peak_tflops)
    slug = "cpu-dry-run" if args.dry_run else device_slug(device.name)
    out = args.out or ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-{slug}"
    store = ResultStore(out, chosen.name)
    plan = chosen.plan(args.dry_run)
    if args.time_limit is not None:
        if args.time_limit <= 0:
            raise ValueError(f"--time-limit must be a number of seconds > 0, got {args.time_limit}")
        plan = dataclasses.replace(
            plan, time_limit_s=args.time_limit, min_launch_s=min(plan.min_launch_s, args.time_limit)
        )
    complete = run_suite(
        chosen,
        plan,
        store,
        device,
        workloads,
        contenders,
        seq_lens=args.seq_len,
        probe=args.probe,
        force=args.force,
        budget_s=args.budget,
    )
    paths = write_report(store, chosen, plan)
    print(f"{'complete' if complete else 'incomplete'}: {store.path}, " + ", ".join(str(p) for p in paths))


def _report(args: argparse.Namespace) -> None:
    found = sorted(args.folder.glob("*.json"))
    suites = [suite(p.stem) for p in found if p.stem in SUITES]
    if not suites:
        raise ValueError(f"{args.folder} holds no results file of a known suite ({', '.join(SUITES)})")
    for item in suites:
        _report_one(args.folder, item)


def _report_one(folder: Path, item: Suite) -> None:
    store = ResultStore(folder, item.name)
    kinds = {row["dry_run"] for row in store.rows.values()}
    if len(kinds) > 1:
        raise ValueError(f"{store.path} mixes dry-run and GPU rows; keep them in separate folders")
    paths = write_report(store, item, item.plan(kinds == {True}))
    print(", ".join(str(p) for p in paths))


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__)
    commands = main.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="suites, workloads and contenders, and which contenders can run here")
    run = commands.add_parser("run", help="run or resume a suite (rows already finished are not run again)")
    run.add_argument("suite", help=f"one of {', '.join(SUITES)}")
    run.add_argument("--dry-run", action="store_true", help="every contender at tiny size on CPU, in seconds")
    run.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<date>-<gpu>)")
    run.add_argument("--workload", action="append", help="only this workload (repeatable)")
    run.add_argument("--contender", action="append", help="only this contender (repeatable)")
    run.add_argument("--seq-len", action="append", type=_positive_int, help="only this length, no search (repeatable)")
    run.add_argument("--probe", action="store_true", help="with --seq-len: one untimed step (does it fit?)")
    run.add_argument("--force", action="store_true", help="run rows again even if they are recorded")
    run.add_argument(
        "--budget", type=float, help="seconds this call may take; it stops between runs, and resumes when called again"
    )
    run.add_argument("--time-limit", type=float, help="seconds one configuration may take (default: the suite's)")
    run.add_argument("--peak-tflops", type=float, help="dense bf16 peak for MFU when the GPU is not in the table")
    report = commands.add_parser("report", help="redraw the markdown table and plots of a results folder")
    report.add_argument("folder", type=Path)
    return main


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        if args.command == "list":
            _list()
        elif args.command == "run":
            if args.probe and not args.seq_len:
                raise ValueError("--probe needs --seq-len")
            _run(args)
        else:
            _report(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
