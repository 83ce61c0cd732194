"""Tests that pass stock but not under an hf_memo mode, each sorted into why."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.transformers_suite.junit import Outcome

# Why a test that passes stock does not pass under hf_memo. Checked in this order.
CATEGORIES = {
    "hf-checkpointing": (
        "Hugging Face gradient checkpointing under an hf_memo recompute mode is refused (issue 13)",
        re.compile(r"cannot be combined with Hugging Face gradient checkpointing"),
    ),
    "needs-issue-14": (
        "recompute='memo' refuses attention masks (padding, packing): packed/padded support is issue 14",
        re.compile(r"recompute='memo' runs causal self-attention over whole sequences"),
    ),
    "memo-attention-dropout": (
        "recompute='memo' refuses attention dropout in training (issue 13)",
        re.compile(r"recompute='memo' computes attention without dropout"),
    ),
    "memo-sliding-window": (
        "recompute='memo' refuses sequences longer than a sliding window",
        re.compile(r"recompute='memo' computes full causal attention"),
    ),
}
# A ``NoneType`` error whose traceback reads ``logits``: hf_memo's training forward with labels returns none.
LOGITS_BY_DESIGN = "logits-by-design"
_NONE = re.compile(r"NoneType|is None|not None")
_READS_LOGITS = re.compile(r"\blogits\b")
REGRESSION = "regression"
# The differences issue 13's acceptance allows: by design, or waiting on packed/padded memo (issue 14).
ALLOWED = ("logits-by-design", "needs-issue-14")  # LOGITS_BY_DESIGN and a key of CATEGORIES


@dataclass(frozen=True)
class Difference:
    """A test passing stock whose outcome under ``mode``/``level`` is ``status`` (failed, error or skipped), or a
    test already failing stock (some of its subtests) with a failure stock does not have (``status`` "new-failure").
    """

    test: str
    mode: str
    level: str
    status: str
    category: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def categorise(message: str, trace: str = "") -> str:
    """The key of :data:`CATEGORIES` whose pattern ``message`` matches, :data:`LOGITS_BY_DESIGN` for a ``None``
    error whose traceback ``trace`` reads ``logits``, else :data:`REGRESSION`."""
    for name, (_, pattern) in CATEGORIES.items():
        if pattern.search(message):
            return name
    if _NONE.search(message) and _READS_LOGITS.search(trace):
        return LOGITS_BY_DESIGN
    return REGRESSION


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
# Two failure lines that differ only in decimals this close are the same failure (a stock assertion on a measured
# value, e.g. a loss reduction of 26.3% both ways, reprints the value with its last float digits changed).
_SAME_NUMBER_RTOL = 1e-2


def same_failure(a: str, b: str) -> bool:
    """Whether failure lines ``a`` and ``b`` are equal but for close numbers (:func:`_close`)."""
    if a == b:
        return True
    if _NUMBER.split(a) != _NUMBER.split(b):
        return False
    return all(_close(x, y) for x, y in zip(_NUMBER.findall(a), _NUMBER.findall(b)))


def _close(x: str, y: str) -> bool:
    """Integers (shapes, counts) must be equal; other numbers within :data:`_SAME_NUMBER_RTOL`."""
    if x.lstrip("+-").isdigit() or y.lstrip("+-").isdigit():
        return x == y
    a, b = float(x), float(y)
    return abs(a - b) <= _SAME_NUMBER_RTOL * max(abs(a), abs(b))


def _new_failures(stock: Outcome, patched: Outcome) -> list[str]:
    """Failures of ``patched`` that ``stock`` does not have (each stock failure excuses one same failure:
    :func:`same_failure`)."""
    excused = list(stock.failures)
    new = []
    for failure in patched.failures:
        match = next((i for i, old in enumerate(excused) if same_failure(old, failure)), None)
        if match is None:
            new.append(failure)
        else:
            excused.pop(match)
    return new


def differences(stock: dict[str, Outcome], patched: dict[str, Outcome], mode: str, level: str) -> list[Difference]:
    """Tests passing in ``stock`` that do not pass in ``patched`` (missing there counts as an error), and tests
    failing in ``stock`` that fail in ``patched`` with failures of their own (a subtest that passed stock)."""
    found = []
    for test, outcome in sorted(stock.items()):
        if outcome.status == "skipped":
            continue
        other = patched.get(test, Outcome("error", "not run (test missing from the report)"))
        if outcome.status == "passed" and other.status != "passed":
            category = categorise(other.message, other.trace)
            found.append(Difference(test, mode, level, other.status, category, other.message))
        elif outcome.status != "passed":
            found += [
                Difference(test, mode, level, "new-failure", categorise(message, other.trace), message)
                for message in _new_failures(outcome, other)
            ]
    return found
