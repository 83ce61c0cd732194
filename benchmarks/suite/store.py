"""The results file of one suite: rows keyed ``suite/workload/contender/seq_len``, rewritten atomically per row."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from benchmarks.suite.search import Longest, longest

DEVICE_OOM = "device_oom"  # out of device memory: the one failure that says a length does not fit
HOST_OOM = "host_oom"  # out of host memory, or the worker killed by the kernel (its OOM killer)
PINNED_OOM = "pinned_oom"  # pinning host memory failed (cudaHostAlloc / cudaHostRegister)
FAILED = (DEVICE_OOM, HOST_OOM, PINNED_OOM, "timeout", "too_slow", "error")  # did not train at that length
FINISHED = ("ok", *FAILED)  # a row with one of these is not run again
PAIR = "-"  # the seq_len part of a row about a whole workload/contender pair (a skipped contender)


def _fit(status: str) -> bool | None:
    return True if status == "ok" else False if status == DEVICE_OOM else None


def fits_of(rows: list[dict[str, Any]]) -> dict[int, bool | None]:
    """Lengths of finished rows and what each showed: trained, out of device memory (``False``) or undecided
    (``None``: a timeout, a too-slow prediction, host or pinned memory, an error) — the search's input."""
    return {r["seq_len"]: _fit(r["status"]) for r in rows if r["status"] in FINISHED and r["seq_len"] is not None}


def row_key(suite: str, workload: str, contender: str, seq_len: int | None) -> str:
    return f"{suite}/{workload}/{contender}/{PAIR if seq_len is None else seq_len}"


class ResultStore:
    """Rows of one suite in ``<folder>/<suite>.json``; each :meth:`put` rewrites the file (write, then rename).

    The file is ``{"suite": name, "rows": {key: row}}``; rows of other runs of the same suite (an
    interrupted run, another day's run into the same folder) are kept and skipped when finished.
    """

    def __init__(self, folder: Path, suite: str) -> None:
        self.path = Path(folder) / f"{suite}.json"
        self.suite = suite
        self.rows: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            data = json.loads(self.path.read_text())
            if data.get("suite") != suite:
                raise ValueError(f"{self.path} holds suite {data.get('suite')!r}, not {suite!r}")
            self.rows = data["rows"]

    def get(self, workload: str, contender: str, seq_len: int | None) -> dict[str, Any] | None:
        return self.rows.get(row_key(self.suite, workload, contender, seq_len))

    def pair_rows(self, workload: str, contender: str) -> list[dict[str, Any]]:
        """Rows of one workload/contender at some sequence length, shortest first."""
        rows = [
            r
            for r in self.rows.values()
            if r["workload"] == workload and r["contender"] == contender and r["seq_len"] is not None
        ]
        return sorted(rows, key=lambda r: r["seq_len"])

    def longest(self, grid: list[int], workload: str, contender: str) -> Longest:
        """The longest-sequence search's result for a pair, from its recorded rows."""
        return longest(grid, fits_of(self.pair_rows(workload, contender)))

    def put(self, row: dict[str, Any]) -> None:
        key = row_key(self.suite, row["workload"], row["contender"], row["seq_len"])
        self.rows[key] = {"key": key, "suite": self.suite, **row}
        self._write()

    def remove(self, workload: str, contender: str, seq_len: int | None) -> None:
        if self.rows.pop(row_key(self.suite, workload, contender, seq_len), None) is not None:
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"suite": self.suite, "rows": self.rows}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
