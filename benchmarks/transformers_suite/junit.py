"""Per-test outcomes from a pytest JUnit XML report."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

STATUSES = ("passed", "skipped", "failed", "error")  # ordered from best to worst


@dataclass(frozen=True)
class Outcome:
    """One test's result: ``status`` (one of :data:`STATUSES`), the first line of its first failure or skip
    message, and the first lines of all its failures and errors (one per failed subtest)."""

    status: str
    message: str = ""
    failures: tuple[str, ...] = ()
    trace: str = field(default="", compare=False)  # the reports' failure texts (tracebacks), for sorting causes


def _first_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0] if lines else ""


def _message(node: ET.Element) -> str:
    return _first_line(node.get("message")) or _first_line(node.text)


def _outcome(case: ET.Element) -> Outcome:
    failed = [node for node in case if node.tag in ("error", "failure")]
    failures = tuple(_message(node) for node in failed)
    trace = "\n".join(node.text or "" for node in failed)
    for tag, status in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
        node = case.find(tag)
        if node is not None:
            return Outcome(status, _message(node), failures, trace)
    return Outcome("passed")


def test_id(case: ET.Element) -> str:
    """``path/of/module.py::Class::test_name`` of a ``<testcase>`` (pytest writes the class path dotted)."""
    parts = case.get("classname", "").split(".")
    module, classes = parts, []
    while module and module[-1][:1].isupper():  # trailing capitalised parts are test classes
        classes.insert(0, module.pop())
    return "::".join(["/".join(module) + ".py", *classes, case.get("name", "")])


def read_outcomes(path: Path) -> dict[str, Outcome]:
    """Every test in the report at ``path`` by id. A test reported more than once keeps its worst outcome and
    the failures of all its reports."""
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key, new = test_id(case), _outcome(case)
        old = outcomes.get(key)
        if old is not None:
            worst = max(old, new, key=lambda o: STATUSES.index(o.status))
            new = Outcome(worst.status, worst.message, old.failures + new.failures, old.trace + "\n" + new.trace)
        outcomes[key] = new
    return outcomes


def read_seconds(path: Path) -> float:
    """Seconds the tests in the report at ``path`` took, as pytest measured them (start-up not included)."""
    return sum(float(suite.get("time", 0)) for suite in ET.parse(path).getroot().iter("testsuite"))
