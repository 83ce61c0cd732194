"""The suite's markdown table and PNG plots, drawn from its results file alone (redrawable at any time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.suite import acceptance
from benchmarks.suite.contenders import ALLOC_CONF, contender
from benchmarks.suite.search import Longest
from benchmarks.suite.store import ResultStore
from benchmarks.suite.suites import Plan, Suite
from benchmarks.suite.workloads import workload

_MARK = {True: "✅", False: "❌"}


def _size(value: int | None, dry_run: bool) -> str:
    if value is None:
        return "—"
    return f"{value / 2**20:.1f} MiB" if dry_run else f"{value / 2**30:.2f} GiB"


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _length(longest_found: Longest) -> str:
    if longest_found.seq_len is None:
        return "none" if longest_found.exact else "—"
    prefix = "" if longest_found.exact else "≥ "
    return f"{prefix}{longest_found.seq_len:,}"


def _mfu(metrics: dict[str, Any]) -> str:
    """The MFU of a timed run; ``unknown`` when its device's peak is not known (no MFU is made up)."""
    if "step_s" in metrics and metrics.get("mfu") is None:
        return "unknown"
    return _num(metrics.get("mfu"), ".1%")


def _host(metrics: dict[str, Any], dry_run: bool) -> str:
    """Pinned host bytes: PyTorch's pinned allocator's peak plus what memo's host pool registered (plain host
    memory in a dry run); else the growth of the process's resident memory."""
    pinned = (metrics.get("pinned_peak_bytes") or 0) + (metrics.get("memo_host_bytes") or 0)
    if pinned:
        return _size(pinned, dry_run) + (" host pool" if dry_run else " pinned")
    before, after = metrics.get("host_rss_before_bytes"), metrics.get("host_rss_after_bytes")
    return "—" if before is None or after is None else _size(after - before, dry_run) + " RSS"


def _environments(store: ResultStore) -> list[str]:
    seen = []
    for row in store.rows.values():
        env = row.get("env") or {}
        if not env:
            continue
        packages = env.get("packages", {})
        text = f"{env.get('device', '?')}, " + ", ".join(f"{k} {v}" for k, v in sorted(packages.items()))
        if text not in seen:
            seen.append(text)
    return seen


def _attempted(store: ResultStore, suite: Suite, workload_name: str) -> tuple[list[str], list[str], list[str]]:
    """The suite's contenders for a workload split into (with runs, skipped, not run yet)."""
    ran, skipped, pending = [], [], []
    for name in suite.contenders:
        if store.get(workload_name, name, None) is not None:
            skipped.append(name)
        elif store.pair_rows(workload_name, name):
            ran.append(name)
        else:
            pending.append(name)
    return ran, skipped, pending


def _memory_key(plan: Plan) -> str:
    """The memory metric summarised and plotted: the reserved peak on a GPU, counted storage in a dry run."""
    return "peak_allocated_bytes" if plan.dry_run else "peak_reserved_bytes"


def _summary_table(store: ResultStore, suite: Suite, plan: Plan, workload_name: str, names: list[str]) -> list[str]:
    ref = plan.reference_length
    base = store.longest(plan.grid, workload_name, acceptance.CHECKPOINTING)
    memory = "peak allocated" if plan.dry_run else "peak reserved"
    lines = [
        f"| contender | longest S | × {acceptance.CHECKPOINTING} | S={ref:,}: step (s) | tokens/s | MFU "
        f"| {memory} | alloc retries | host memory | loss | {ALLOC_CONF} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        found = store.longest(plan.grid, workload_name, name)
        ratio = "—"
        if found.seq_len and base.seq_len and found.complete and base.complete:
            exact = found.exact and base.exact
            ratio = f"{'' if exact else '~'}{found.seq_len / base.seq_len:.2f}"
        row = store.get(workload_name, name, ref)
        metrics = row["metrics"] if row and row["status"] == "ok" else {}
        conf = next((r["env"].get(ALLOC_CONF) for r in store.pair_rows(workload_name, name) if r.get("env")), None)
        lines.append(
            f"| {name} | {_length(found)} | {ratio} | {_num(metrics.get('step_s'), '.3g')} "
            f"| {_num(metrics.get('tokens_per_s'), ',.0f')} | {_mfu(metrics)} "
            f"| {_size(metrics.get(_memory_key(plan)), plan.dry_run)} | {metrics.get('num_alloc_retries', '—')} "
            f"| {_host(metrics, plan.dry_run) if metrics else '—'} | {_num(metrics.get('loss'), '.4f')} "
            f"| {'—' if conf is None else f'`{conf}`'} |"
        )
    return lines


def _runs_table(store: ResultStore, plan: Plan, workload_name: str, names: list[str]) -> tuple[list[str], list[str]]:
    lines = [
        "| contender | S | kind | status | step (s) | tokens/s | MFU | peak allocated | peak reserved "
        "| alloc retries | host memory | reproduce |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name in names:
        for row in store.pair_rows(workload_name, name):
            metrics = row["metrics"]
            status = row["status"]
            if row.get("reason"):
                notes.append(f"{name} S={row['seq_len']:,} {status}: {row['reason'].strip().splitlines()[-1]}")
                status = f"{status} [{len(notes)}]"
            lines.append(
                f"| {name} | {row['seq_len']:,} | {row['kind']} | {status} | {_num(metrics.get('step_s'), '.3g')} "
                f"| {_num(metrics.get('tokens_per_s'), ',.0f')} | {_mfu(metrics)} "
                f"| {_size(metrics.get('peak_allocated_bytes'), plan.dry_run)} "
                f"| {_size(metrics.get('peak_reserved_bytes'), plan.dry_run)} "
                f"| {metrics.get('num_alloc_retries', '—')} | {_host(metrics, plan.dry_run)} | `{row['command']}` |"
            )
    return lines, notes


def _judged(mark: bool | None, text: str) -> str:
    return text if mark is None else f"{text} {_MARK[mark]}"


def _acceptance_table(store: ResultStore, plan: Plan, names: list[str]) -> list[str]:
    min_longest = acceptance.MIN_LONGEST // plan.scale
    lines = [
        f"Acceptance targets: longest S ≥ {acceptance.MIN_LONGEST_RATIO:g}× {acceptance.CHECKPOINTING}'s and "
        f"≥ {min_longest:,}; MFU ≥ {acceptance.MIN_MFU:.0%} at S={plan.reference_length:,}; tokens/s ≥ "
        f"{acceptance.MIN_SPEEDUP:g}× {acceptance.CHECKPOINTING_OFFLOAD}'s at the same S; no allocator retries for "
        f"{acceptance.PLANNED} (✅ met, ❌ missed, no mark: not judged yet).",
        "",
        f"| hf_memo contender | longest S (× {acceptance.CHECKPOINTING}) | MFU | tokens/s × "
        f"{acceptance.CHECKPOINTING_OFFLOAD} | alloc retries |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        v = acceptance.verdict(store, plan, name)
        longest_text = f"{_length(v.longest)} ({_num(v.longest_ratio, '.2f')}×)"
        lines.append(
            f"| {name} | {_judged(v.longest_ok, longest_text)} | {_judged(v.mfu_ok, _num(v.mfu, '.1%'))} "
            f"| {_judged(v.speedup_ok, _num(v.speedup, '.2f'))} | {_judged(v.retries_ok, _num(v.alloc_retries, 'd'))} |"
        )
    return lines


def markdown(store: ResultStore, suite: Suite, plan: Plan) -> str:
    """The suite's results as markdown: per workload a summary, every run with its command, and skips."""
    where = "CPU dry run: tiny models, checks the suite and measures nothing" if plan.dry_run else "GPU"
    lines = [
        f"## Benchmark suite `{suite.name}` ({where})",
        "",
        f"{suite.description}. Longest S: bisection on a {plan.grid[0]:,}-token grid up to {plan.grid[-1]:,}, "
        f"each length one training step in its own process, {plan.time_limit_s:.0f} s at most. "
        'Only running out of device memory bounds the longest S; "≥" marks a lower bound (the next length '
        "timed out, was predicted too slow, ran out of host or pinned memory or failed otherwise, or the grid "
        'ended), and "~" a ratio with one. Step time and tokens/s are medians of steady-state steps after a '
        "warm-up step. MFU counts model FLOPs per step of 6 per trainable and 4 per frozen matrix weight per token "
        "(embedding lookups none) plus 6·n·a·S² for causal attention (hf_memo.integrations.flops); "
        '"unknown" where the device\'s peak is not known (give --peak-tflops). '
        f"Run or resume it all: `python -m benchmarks.suite run {suite.name}{' --dry-run' if plan.dry_run else ''}`.",
        "",
        "Measured on: " + ("; ".join(_environments(store)) or "nothing yet"),
    ]
    for workload_name in suite.workloads:
        ran, skipped, pending = _attempted(store, suite, workload_name)
        lines += ["", f"### {workload_name}: {workload(workload_name).description}"]
        if ran:
            lines += ["", *_summary_table(store, suite, plan, workload_name, ran)]
            memo = [name for name in ran if contender(name).is_hf_memo]
            if workload_name == acceptance.WORKLOAD and memo:
                lines += ["", *_acceptance_table(store, plan, memo)]
            runs, notes = _runs_table(store, plan, workload_name, ran)
            lines += ["", "All runs:", "", *runs]
            if notes:
                lines += ["", *[f"[{i}] {note}" for i, note in enumerate(notes, 1)]]
        if skipped:
            lines += ["", "Skipped:", ""]
            lines += [f"- {name}: {store.get(workload_name, name, None)['reason'].splitlines()[0]}" for name in skipped]
        if pending:
            lines += ["", f"Not run yet: {', '.join(pending)}."]
    return "\n".join(lines) + "\n"


def plot(store: ResultStore, suite: Suite, plan: Plan, workload_name: str, path: Path) -> None:
    """Longest trainable sequence, tokens/s and peak memory against S, one line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, unit_name = (2**20, "MiB") if plan.dry_run else (2**30, "GiB")
    fig, (ax_longest, ax_speed, ax_memory) = plt.subplots(1, 3, figsize=(18, 5))
    ran, _, _ = _attempted(store, suite, workload_name)
    lengths, lower_bound = [], []
    for name in ran:
        found = store.longest(plan.grid, workload_name, name)
        lengths.append(found.seq_len or 0)
        lower_bound.append(not found.exact)
        rows = [r for r in store.pair_rows(workload_name, name) if r["status"] == "ok"]
        timed = [r for r in rows if "tokens_per_s" in r["metrics"]]
        if timed:
            ax_speed.plot(
                [r["seq_len"] for r in timed], [r["metrics"]["tokens_per_s"] for r in timed], "o-", label=name
            )
        measured = [r for r in rows if r["metrics"].get(_memory_key(plan))]
        if measured:
            memory = [r["metrics"][_memory_key(plan)] / unit for r in measured]
            ax_memory.plot([r["seq_len"] for r in measured], memory, "o-", label=name)
    for bar, hatched in zip(ax_longest.barh(ran, lengths), lower_bound):
        if hatched:
            bar.set_hatch("//")
    ax_longest.set(xlabel="tokens (hatched: lower bound)", title="longest trainable S")
    ax_speed.set(xlabel="sequence length S", ylabel="tokens / s", xscale="log", title="throughput")
    memory_label = "peak allocated (counted)" if plan.dry_run else "peak reserved"
    ax_memory.set(xlabel="sequence length S", ylabel=f"{memory_label} ({unit_name})", xscale="log", title="memory")
    for ax in (ax_speed, ax_memory):
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"{suite.name} / {workload_name}{' (CPU dry run)' if plan.dry_run else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(store: ResultStore, suite: Suite, plan: Plan) -> list[Path]:
    """Write ``<suite>.md`` and one ``<suite>-<workload>.png`` per workload next to the results file."""
    folder = store.path.parent
    table = folder / f"{suite.name}.md"
    table.write_text(markdown(store, suite, plan))
    paths = [table]
    for workload_name in suite.workloads:
        path = folder / f"{suite.name}-{workload_name}.png"
        plot(store, suite, plan, workload_name, path)
        paths.append(path)
    return paths
