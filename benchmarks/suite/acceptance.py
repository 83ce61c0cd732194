"""The acceptance targets of the suite (Llama-3-8B LoRA on one H200), checked against recorded rows.

For every hf_memo contender: longest trainable sequence at least 8x HF checkpointing's and at least
256K tokens; MFU at least 45% at the reference length (128K); tokens/s at least 1.2x HF
checkpointing + offload at the same length; and, for MEMO with the planner, no allocator retries.
A target is ``None`` (not judged) while a number it needs is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.suite.search import Longest
from benchmarks.suite.store import ResultStore
from benchmarks.suite.suites import Plan

WORKLOAD = "llama3-8b-lora"
CHECKPOINTING = "hf+ckpt"
CHECKPOINTING_OFFLOAD = "hf+ckpt+offload"
PLANNED = "memo+planner"
MIN_LONGEST_RATIO = 8.0
MIN_LONGEST = 256 * 1024  # real tokens; a dry run divides it by its scale
MIN_MFU = 0.45
MIN_SPEEDUP = 1.2


@dataclass(frozen=True)
class Verdict:
    """One hf_memo contender against the targets; each check is ``True``, ``False`` or ``None`` (not judged)."""

    contender: str
    longest: Longest
    longest_ratio: float | None
    mfu: float | None
    speedup: float | None
    alloc_retries: int | None
    longest_ok: bool | None
    mfu_ok: bool | None
    speedup_ok: bool | None
    retries_ok: bool | None


def _reference_row(store: ResultStore, contender: str, plan: Plan) -> dict[str, Any] | None:
    row = store.get(WORKLOAD, contender, plan.reference_length)
    return row if row is not None and row["status"] == "ok" and row["kind"] == "timed" else None


def _at_least(value: float | None, threshold: float) -> bool | None:
    return None if value is None else value >= threshold


def verdict(store: ResultStore, plan: Plan, contender: str) -> Verdict:
    """How ``contender`` stands against every target, from the rows recorded so far."""
    own, base = store.longest(plan.grid, WORKLOAD, contender), store.longest(plan.grid, WORKLOAD, CHECKPOINTING)
    ratio = None
    longest_ok = None
    if own.complete and base.complete and own.seq_len is not None and base.seq_len is not None:
        ratio = own.seq_len / base.seq_len
        met = ratio >= MIN_LONGEST_RATIO and own.seq_len >= MIN_LONGEST // plan.scale
        # A lower bound of ours that meets the target against the baseline's exact limit meets it; our exact
        # limit that misses it misses it against any baseline at least this long. Otherwise: not judged.
        if met and base.exact:
            longest_ok = True
        elif not met and own.exact:
            longest_ok = False
    row, offload = _reference_row(store, contender, plan), _reference_row(store, CHECKPOINTING_OFFLOAD, plan)
    mfu = row["metrics"].get("mfu") if row else None
    speedup = None
    if row and offload and "tokens_per_s" in row["metrics"] and "tokens_per_s" in offload["metrics"]:
        speedup = row["metrics"]["tokens_per_s"] / offload["metrics"]["tokens_per_s"]
    retries = None
    if contender == PLANNED:
        counts = [
            r["metrics"]["num_alloc_retries"]
            for r in store.pair_rows(WORKLOAD, contender)
            if r["status"] == "ok" and "num_alloc_retries" in r["metrics"]
        ]
        retries = max(counts) if counts else None
    return Verdict(
        contender=contender,
        longest=own,
        longest_ratio=ratio,
        mfu=mfu,
        speedup=speedup,
        alloc_retries=retries,
        longest_ok=longest_ok,
        mfu_ok=_at_least(mfu, MIN_MFU),
        speedup_ok=_at_least(speedup, MIN_SPEEDUP),
        retries_ok=None if retries is None else retries == 0,
    )
