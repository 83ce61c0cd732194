"""Runs a suite: every configuration in its own worker process, each row recorded as soon as it ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.suite.contenders import ALLOC_CONF, contender, unavailable_reason
from benchmarks.suite.search import next_length
from benchmarks.suite.store import FAILED, FINISHED, HOST_OOM, ResultStore, fits_of
from benchmarks.suite.suites import Plan, Suite
from benchmarks.suite.worker import Job
from hf_memo.integrations.flops import FlopModel, peak_flops_of

ROOT = Path(__file__).resolve().parents[2]
_LOG_TAIL_CHARS = 2000
_PREDICTION_MARGIN = 0.8  # a length is not run when its predicted step takes more than this share of the limit


class BudgetSpent(Exception):
    """The time budget of this invocation is used up; the suite resumes on the next invocation."""


@dataclass(frozen=True)
class Device:
    """The device the workers run on: its name and dense bf16 peak (FLOP/s) for MFU."""

    name: str
    peak_flops: float | None


def detect_device(dry_run: bool, peak_tflops: float | None) -> Device:
    """The CUDA device the workers will use, asked in a short subprocess so this process never holds a CUDA context.

    Raises ``ValueError`` when a real run finds no CUDA device.
    """
    if dry_run:
        return Device("cpu", None)
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    name = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    if not name:
        raise ValueError("no CUDA device is visible; use --dry-run for the CPU dry run")
    return Device(name, peak_tflops * 1e12 if peak_tflops is not None else peak_flops_of(name))


class Budget:
    """Seconds this invocation may still spend (``None``: unlimited)."""

    def __init__(self, seconds: float | None) -> None:
        self._end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self._end is None else self._end - time.monotonic()


def reproduce_command(
    suite: str, workload_name: str, contender_name: str, seq_len: int, timed: bool, dry_run: bool
) -> str:
    """The command line that runs exactly this row again (replacing it)."""
    parts = ["python -m benchmarks.suite run", suite, "--workload", workload_name, "--contender", contender_name]
    parts += ["--seq-len", str(seq_len)]
    if not timed:
        parts.append("--probe")
    if dry_run:
        parts.append("--dry-run")
    return " ".join([*parts, "--force"])


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-_LOG_TAIL_CHARS:]


def _no_result(returncode: int) -> dict[str, Any]:
    """The outcome of a worker that ended without writing its result: killed by SIGKILL, or exited."""
    if returncode == -signal.SIGKILL:
        status = HOST_OOM
        reason = "the worker was killed by SIGKILL without writing a result: most likely the kernel's OOM killer"
    else:
        status, reason = "error", f"the worker exited with code {returncode} without writing a result"
    return {"status": status, "reason": reason, "metrics": {}, "env": {}}


class SuiteRunner:
    """Runs the configurations of one suite into a :class:`ResultStore`, skipping rows already finished."""

    def __init__(
        self, suite: Suite, plan: Plan, store: ResultStore, device: Device, budget: Budget, force: bool
    ) -> None:
        self.suite = suite
        self.plan = plan
        self.store = store
        self.device = device
        self.budget = budget
        self.force = force
        self._ran: set[tuple[str, str, int]] = set()  # rows run by this invocation (``force`` runs each once)

    # ---- one workload/contender pair -------------------------------------------------------------------------

    def run_pair(self, workload_name: str, contender_name: str, seq_lens: list[int] | None, probe: bool) -> None:
        """Run explicit ``seq_lens`` (timed, or one-step probes), else the timed lengths and the longest-S search."""
        reason = unavailable_reason(contender(contender_name), self.plan.dry_run)
        if reason is not None:
            self._skip(workload_name, contender_name, reason)
            return
        self.store.remove(workload_name, contender_name, None)
        if seq_lens:
            for seq_len in seq_lens:
                if self._ensure(workload_name, contender_name, seq_len, timed=not probe) is None:
                    return
            return
        for seq_len in self.plan.timed_lengths:
            row = self._ensure(workload_name, contender_name, seq_len, timed=True)
            if row is None:
                return
            if row["status"] != "ok":
                break
        while (seq_len := next_length(self.plan.grid, self.fits(workload_name, contender_name))) is not None:
            if self._ensure(workload_name, contender_name, seq_len, timed=False) is None:
                return

    def fits(self, workload_name: str, contender_name: str) -> dict[int, bool | None]:
        """Recorded lengths of a pair and what each showed (see :func:`~benchmarks.suite.store.fits_of`)."""
        return fits_of(self.store.pair_rows(workload_name, contender_name))

    def _skip(self, workload_name: str, contender_name: str, reason: str) -> None:
        self.store.put(
            dict(
                workload=workload_name,
                contender=contender_name,
                seq_len=None,
                kind=None,
                status="skipped",
                reason=reason,
                dry_run=self.plan.dry_run,
            )
        )
        tqdm.write(f"{workload_name} {contender_name}: skipped ({reason.splitlines()[0]})")

    def _ensure(self, workload_name: str, contender_name: str, seq_len: int, timed: bool) -> dict[str, Any] | None:
        """The row at ``seq_len``, run unless already finished; ``None`` if the contender turned out unavailable."""
        row = self.store.get(workload_name, contender_name, seq_len)
        ran_now = (workload_name, contender_name, seq_len) in self._ran
        finished = row is not None and row["status"] in FINISHED
        upgrade = finished and timed and row["kind"] == "probe" and row["status"] == "ok"
        if finished and not upgrade and (ran_now or not self.force):
            return row
        self._ran.add((workload_name, contender_name, seq_len))
        outcome = self._predicted_too_slow(workload_name, contender_name, seq_len) or self._launch(
            workload_name, contender_name, seq_len, timed
        )
        if outcome["status"] == "unavailable":
            self._skip(workload_name, contender_name, outcome["reason"])
            return None
        row = dict(
            workload=workload_name,
            contender=contender_name,
            seq_len=seq_len,
            kind="timed" if timed else "probe",
            dry_run=self.plan.dry_run,
            command=reproduce_command(
                self.suite.name, workload_name, contender_name, seq_len, timed, self.plan.dry_run
            ),
            finished_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
            **outcome,
        )
        self.store.put(row)
        step = row["metrics"].get("step_s")
        detail = f", {step:.3g} s/step" if step else ""
        tqdm.write(f"{workload_name} {contender_name} S={seq_len} {row['kind']}: {row['status']}{detail}")
        return row

    def _predicted_too_slow(self, workload_name: str, contender_name: str, seq_len: int) -> dict[str, Any] | None:
        """A ``too_slow`` outcome when the pair's longest shorter timed run, scaled by model FLOPs, would overrun
        the limit.

        Costs no device time: a length that cannot finish inside the limit is not started. Only
        steady-state step times count (timed runs' median ``step_s``): a probe's single step also pays
        for calibration, planning, pinning and warm-up, which do not grow like a step.
        """
        shorter = [
            r
            for r in self.store.pair_rows(workload_name, contender_name)
            if r["status"] == "ok" and r["seq_len"] < seq_len and {"step_s", "flop_model"} <= r["metrics"].keys()
        ]
        if not shorter:
            return None
        ref = shorter[-1]
        metrics = ref["metrics"]
        flop_model = FlopModel(**metrics["flop_model"])
        scale = flop_model.flops(seq_len, seq_len**2) / flop_model.flops(ref["seq_len"], ref["seq_len"] ** 2)
        predicted = metrics["step_s"] * scale
        if predicted <= _PREDICTION_MARGIN * self.plan.time_limit_s:
            return None
        return {
            "status": "too_slow",
            "reason": (
                f"not run: a step is predicted to take {predicted:.0f} s (the {metrics['step_s']:.1f} s median step "
                f"at S={ref['seq_len']} scaled by model FLOPs), over {_PREDICTION_MARGIN:.0%} of the "
                f"{self.plan.time_limit_s:.0f} s limit"
            ),
            "metrics": {},
            "env": {},
        }

    # ---- one worker process -----------------------------------------------------------------------------------

    def _launch(self, workload_name: str, contender_name: str, seq_len: int, timed: bool) -> dict[str, Any]:
        """Run one configuration in a worker process; its outcome (status, reason, metrics, env, wall time)."""
        timeout = min(self.plan.time_limit_s, self.budget.left())
        if timeout < self.plan.min_launch_s:
            raise BudgetSpent
        job = Job(
            workload=workload_name,
            contender=contender_name,
            seq_len=seq_len,
            timed=timed,
            dry_run=self.plan.dry_run,
            dry_run_scale=self.plan.scale,
            max_timed_steps=self.plan.max_timed_steps,
            min_measure_s=self.plan.min_measure_s,
            time_limit_s=timeout,
            peak_flops=self.device.peak_flops,
        )
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            ALLOC_CONF: contender(contender_name).cuda_alloc_conf,  # never the shell's
        }
        with tempfile.TemporaryDirectory() as tmp:
            job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
            job_path.write_text(json.dumps(asdict(job)))
            command = [sys.executable, "-m", "benchmarks.suite.worker", str(job_path), str(result_path)]
            started = time.monotonic()
            try:
                done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as expired:
                if timeout < self.plan.time_limit_s:
                    raise BudgetSpent from None  # cut short by the budget: not a result, run it again next time
                return {
                    "status": "timeout",
                    "reason": f"killed after the {timeout:g} s limit",
                    "metrics": {},
                    "env": {},
                    "wall_s": time.monotonic() - started,
                    "log_tail": _tail(expired.stderr),
                }
            wall = time.monotonic() - started
            if result_path.exists():
                outcome = json.loads(result_path.read_text())
                outcome.pop("job", None)
            else:
                outcome = _no_result(done.returncode)
        outcome["wall_s"] = wall
        if outcome["status"] in FAILED:
            outcome["log_tail"] = _tail(done.stderr)
        return outcome


def run_suite(
    suite: Suite,
    plan: Plan,
    store: ResultStore,
    device: Device,
    workloads: list[str],
    contenders: list[str],
    seq_lens: list[int] | None = None,
    probe: bool = False,
    force: bool = False,
    budget_s: float | None = None,
) -> bool:
    """Run (or resume) ``suite`` as ``plan`` says into ``store``; ``True`` when every selected configuration finished.

    Returns ``False`` when the budget ran out first: the same call resumes where this one stopped.
    """
    runner = SuiteRunner(suite, plan, store, device, Budget(budget_s), force)
    pairs = [(w, c) for w in workloads for c in contenders]
    progress = tqdm(pairs, desc=f"{suite.name}{' (dry run)' if plan.dry_run else ''}", unit="pair")
    try:
        for workload_name, contender_name in progress:
            progress.set_postfix_str(f"{workload_name} {contender_name}")
            runner.run_pair(workload_name, contender_name, seq_lens, probe)
    except BudgetSpent:
        tqdm.write("stopped: the time budget is spent; run the same command again to resume")
        return False
    finally:
        progress.close()
    return True
