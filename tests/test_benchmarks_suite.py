"""The side-by-side benchmark suite (benchmarks/suite): search, metrics, memory counting, and its CPU dry run.

The dry-run tests run real worker processes on tiny models (a few seconds each), so they check the
same code paths a GPU run takes: one process per configuration, JSON rows appended, resume,
out-of-memory / crash / timeout recording, skipped contenders, the markdown table and the plots.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.suite import __main__ as cli
from benchmarks.suite import acceptance, worker
from benchmarks.suite.contenders import ALLOC_CONF, CONTENDERS, unavailable_reason
from benchmarks.suite.metrics import device_slug
from benchmarks.suite.report import _length
from benchmarks.suite.runner import Budget, Device, SuiteRunner, detect_device
from benchmarks.suite.search import length_grid, longest, next_length
from benchmarks.suite.store import ResultStore, fits_of
from benchmarks.suite.suites import DRY_RUN_SCALE, suite
from hf_memo.integrations.flops import FlopModel

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = "llama3-8b-lora"
DRY_GRID = suite("h200").plan(dry_run=True).grid


def _search(grid: list[int], limit: int | None, seed: dict[int, bool] | None = None) -> tuple[dict[int, bool], int]:
    """Run the search against a device where exactly the lengths <= ``limit`` fit; (outcomes, runs)."""
    fits = dict(seed or {})
    runs = 0
    while (seq_len := next_length(grid, fits)) is not None:
        assert seq_len in grid and seq_len not in fits, "the search asked for a length twice or off the grid"
        fits[seq_len] = limit is not None and seq_len <= limit
        runs += 1
    return fits, runs


@pytest.mark.parametrize("seed", [{}, {16: True, 128: False}, {16: True, 128: True}])
def test_search_finds_the_exact_limit_with_logarithmic_runs(seed):
    grid = length_grid(16, 1024)
    for limit in [None, *grid]:
        consistent = {s: ok for s, ok in seed.items() if ok == (limit is not None and s <= limit)}
        fits, runs = _search(grid, limit, consistent)
        found = longest(grid, fits)
        assert found.complete
        assert found.seq_len == limit, f"limit {limit}: found {found.seq_len}"
        assert found.exact == (limit != grid[-1])  # at the grid's end the true limit may be longer
        assert runs <= 2 * math.ceil(math.log2(len(grid))) + 1, f"limit {limit}: {runs} runs"


def test_search_reports_an_interrupted_search_as_a_lower_bound():
    grid = length_grid(16, 1024)
    found = longest(grid, {16: True, 32: True})
    assert (found.seq_len, found.complete) == (32, False)
    assert next_length(grid, {16: True, 32: True}) == 64  # galloping: the length doubles


def test_grid_rejects_a_maximum_off_the_step():
    with pytest.raises(ValueError, match="multiple of the step"):
        length_grid(16, 100)


def test_a_timeout_or_any_failure_but_device_memory_leaves_a_lower_bound():
    grid = length_grid(16, 1024)
    for status in ("timeout", "too_slow", "host_oom", "pinned_oom", "error"):
        fits = fits_of([_row("hf", 16), _row("hf", 32), _row("hf", 64, status)])
        assert fits == {16: True, 32: True, 64: None}
        assert next_length(grid, fits) == 48  # still bisects below it
        fits[48] = True
        found = longest(grid, fits)
        assert (found.seq_len, found.complete, found.exact) == (48, True, False)
        assert _length(found) == "≥ 48"
    fits = fits_of([_row("hf", 16), _row("hf", 32), _row("hf", 48, "device_oom"), _row("hf", 64, "timeout")])
    found = longest(grid, fits)
    assert (found.seq_len, found.complete, found.exact) == (32, True, True) and _length(found) == "32"
    assert _length(longest(grid, fits_of([_row("hf", 16, "timeout")]))) == "—"
    assert _length(longest(grid, fits_of([_row("hf", 16, "device_oom")]))) == "none"


def _failure(raiser) -> str:
    try:
        raiser()
    except Exception as error:
        return worker.classify(error)
    raise AssertionError("nothing raised")


class _CudaError(RuntimeError):
    def __init__(self, size: int, pin_memory: bool) -> None:
        super().__init__("CUDA error: out of memory")  # PyTorch's message when cudaHostAlloc fails


def _pack_to_cpu(size: int) -> None:
    """Fails where torch.autograd.graph.save_on_cpu's pack hook calls torch.empty(..., pin_memory=...)."""
    raise _CudaError(
        size,
        pin_memory=True,
    )


def _device_kernel():
    raise RuntimeError("CUDA error: out of memory")


def test_failures_are_classified_as_pinned_host_or_device_memory_or_an_error():
    def raises(error):
        def raiser():
            raise error

        return raiser

    assert _failure(lambda: _pack_to_cpu(4)) == "pinned_oom"  # named on the statement's second line
    assert _failure(lambda: torch.empty(2**62, dtype=torch.uint8)) == "host_oom"  # the CPU allocator's own error
    assert _failure(raises(MemoryError())) == "host_oom"
    assert _failure(raises(RuntimeError("cudaHostRegister could not pin 4096 bytes of host memory"))) == "pinned_oom"
    assert _failure(raises(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))) == "device_oom"
    assert _failure(_device_kernel) == "device_oom"
    assert _failure(raises(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))) == "device_oom"
    assert _failure(raises(ValueError("shapes do not match"))) == "error"


@pytest.mark.parametrize(
    ("name", "tflops"),
    [("NVIDIA H200", 989), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA A100-SXM4-80GB", 312)],
)
def test_mfu_peak_is_known_for_h100_h200_and_a100_not_only_one_exact_name(monkeypatch, name, tflops):
    monkeypatch.setattr(
        "benchmarks.suite.runner.subprocess.run", lambda *a, **k: subprocess.CompletedProcess(a, 0, name + "\n", "")
    )
    assert detect_device(dry_run=False, peak_tflops=None) == Device(name, tflops * 1e12)
    assert detect_device(dry_run=False, peak_tflops=100.0) == Device(name, 100e12)


def test_step_time_predictions_use_steady_state_steps_only(tmp_path):
    plan = suite("h200").plan(dry_run=False)  # 480 s limit: a prediction over 384 s is not run
    store = ResultStore(tmp_path, "h200")
    model = FlopModel(trainable=1000, frozen=7000, layers=2, attention_width=64)
    runner = SuiteRunner(suite("h200"), plan, store, Device("NVIDIA H200", 989e12), Budget(None), force=False)
    k = 1024
    # a probe's only step took 300 s (calibration, planning, pinning, warm-up): no prediction from it
    store.put(_row("memo-auto", 16 * k, flop_model=dataclasses.asdict(model), first_step_s=300.0))
    assert runner._predicted_too_slow(WORKLOAD, "memo-auto", 64 * k) is None
    # a timed run's median step of 30 s at 16K: 64K costs flops(64K) / flops(16K) times that
    store.put(_row("memo-auto", 16 * k, kind="timed", flop_model=dataclasses.asdict(model), step_s=30.0))
    per_token, per_square = 6 * 1000 + 4 * 7000, 6 * 2 * 64
    ratio = (per_token * 64 * k + per_square * (64 * k) ** 2) / (per_token * 16 * k + per_square * (16 * k) ** 2)
    assert ratio * 30.0 > 384 and 8 < ratio < 16
    outcome = runner._predicted_too_slow(WORKLOAD, "memo-auto", 64 * k)
    assert outcome["status"] == "too_slow" and f"{ratio * 30.0:.0f} s" in outcome["reason"]
    assert runner._predicted_too_slow(WORKLOAD, "memo-auto", 32 * k) is None  # about 120 s


def test_device_slug():
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert device_slug("cpu") == "cpu"


MEMO_MODES = ("selective", "memo-auto", "memo+planner")


def test_every_hf_memo_contender_has_a_valid_config_and_runs_in_the_dry_run():
    from hf_memo import MemoConfig

    for name in MEMO_MODES:
        MemoConfig(**CONTENDERS[name].memo)
        assert unavailable_reason(CONTENDERS[name], dry_run=True) is None


def test_contenders_needing_cuda_or_missing_packages_are_skipped():
    liger = unavailable_reason(CONTENDERS["hf+liger-flce"], dry_run=True)
    assert liger is not None and ("not importable" in liger or "CUDA" in liger)
    assert unavailable_reason(CONTENDERS["minseq"], dry_run=True) is None


def _row(contender: str, seq_len: int, status: str = "ok", kind: str = "probe", **metrics) -> dict:
    return dict(workload=WORKLOAD, contender=contender, seq_len=seq_len, kind=kind, status=status, metrics=metrics)


def test_acceptance_targets_are_judged_from_recorded_rows(tmp_path):
    plan = suite("acceptance").plan(dry_run=False)
    k = 1024
    store = ResultStore(tmp_path, "acceptance")
    for seq_len, ok in ((16 * k, True), (32 * k, True), (48 * k, False)):
        store.put(_row(acceptance.CHECKPOINTING, seq_len, "ok" if ok else "device_oom"))
    store.put(_row(acceptance.CHECKPOINTING_OFFLOAD, 128 * k, kind="timed", tokens_per_s=1000.0))
    for seq_len in (128 * k, 256 * k):
        store.put(_row(acceptance.PLANNED, seq_len, num_alloc_retries=0))
    store.put(_row(acceptance.PLANNED, 128 * k, kind="timed", tokens_per_s=1250.0, mfu=0.47, num_alloc_retries=0))
    # 256K fits, 272K runs out of memory: a complete search, 8x the checkpointing baseline
    store.put(_row(acceptance.PLANNED, 272 * k, "device_oom"))
    verdict = acceptance.verdict(store, plan, acceptance.PLANNED)
    assert verdict.longest.seq_len == 256 * k and verdict.longest_ratio == 8.0
    assert (verdict.longest_ok, verdict.mfu_ok, verdict.speedup_ok, verdict.retries_ok) == (True, True, True, True)

    store.put(_row(acceptance.PLANNED, 128 * k, kind="timed", tokens_per_s=1100.0, mfu=0.40, num_alloc_retries=3))
    verdict = acceptance.verdict(store, plan, acceptance.PLANNED)
    assert (verdict.mfu_ok, verdict.speedup_ok, verdict.retries_ok) == (False, False, False)
    assert acceptance.verdict(store, plan, "minseq").longest_ok is None  # nothing measured: not judged

    # a timeout above a length that meets the target still meets it; one above a length that misses it: not judged
    store.put(_row(acceptance.PLANNED, 272 * k, "timeout"))
    assert acceptance.verdict(store, plan, acceptance.PLANNED).longest_ok is True
    for seq_len, status in ((16 * k, "ok"), (32 * k, "ok"), (48 * k, "timeout")):
        store.put(_row("memo-auto", seq_len, status))
    verdict = acceptance.verdict(store, plan, "memo-auto")
    assert (verdict.longest.seq_len, verdict.longest.exact, verdict.longest_ok) == (32 * k, False, None)


def test_command_line_rejects_bad_input_with_one_line(capsys):
    for argv, needle in (
        (["run", "nope", "--dry-run"], "unknown suite 'nope'"),
        (["run", "h200", "--dry-run", "--contender", "fast"], "--contender fast is not in suite h200"),
        (["run", "h200", "--dry-run", "--probe"], "--probe needs --seq-len"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1


def test_deepspeed_tiled_wiring_gives_hugging_face_s_loss_and_gradients(monkeypatch):
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    from benchmarks.suite import baselines

    config = LlamaConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        use_cache=False,
    )
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).train()
    model = copy.deepcopy(reference)
    baselines.install_deepspeed_tiled_mlp(model)
    model.activation_checkpointing_enable()
    monkeypatch.setattr(baselines, "_LOGITS_SHARD_BYTES", 67 * 101 * 4 // 3)  # several loss shards, one shorter
    ids = torch.randint(0, 101, (1, 67))
    labels = ids.clone()
    labels[0, ::5] = -100
    expected = reference(input_ids=ids, labels=labels).loss
    expected.backward()
    loss = baselines.deepspeed_tiled_loss(model, ids, labels)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference_params[name].grad, msg=name)


# ---- the dry run, end to end --------------------------------------------------------------------------------


def _run(out: Path, *args: str) -> None:
    cli.main(["run", "h200", "--dry-run", "--out", str(out), "--workload", WORKLOAD, *args])


@pytest.fixture(scope="module")
def dry_run_with_log(tmp_path_factory) -> tuple[Path, str]:
    """One dry run: plain HF through its whole plan, skipped contenders, hf_memo at two lengths."""
    out = tmp_path_factory.mktemp("suite")
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        _run(out, "--contender", "hf", "--contender", "hf+liger-flce", "--contender", "hf+ckpt+offload")
        _run(out, "--contender", "minseq", "--contender", "memo-auto", "--seq-len", "32", "--seq-len", "256")
    return out, log.getvalue()


@pytest.fixture
def dry_run(dry_run_with_log) -> Path:
    return dry_run_with_log[0]


def _rows(out: Path) -> dict[str, dict]:
    return json.loads((out / "h200.json").read_text())["rows"]


def test_dry_run_times_searches_and_records_out_of_memory(dry_run):
    rows = _rows(dry_run)
    hf = {r["seq_len"]: r for r in rows.values() if r["contender"] == "hf"}
    timed = hf[32]
    assert timed["status"] == "ok" and timed["kind"] == "timed" and timed["dry_run"] is True
    assert timed["metrics"]["step_s"] > 0 and timed["metrics"]["tokens_per_s"] == pytest.approx(
        32 / timed["metrics"]["step_s"]
    )
    assert timed["metrics"]["peak_allocated_bytes"] > 0 and timed["env"]["device"] == "cpu"
    assert hf[256]["status"] == "device_oom" and "emulated capacity" in hf[256]["reason"]
    # the search ended between a fitting length and the next grid length, which did not fit
    found = longest(DRY_GRID, {s: r["status"] == "ok" for s, r in hf.items()})
    assert found.complete and found.seq_len is not None
    assert hf[found.seq_len]["status"] == "ok" and hf[found.seq_len + DRY_GRID[0]]["status"] == "device_oom"
    assert all(r["kind"] == "probe" for s, r in hf.items() if s not in (32, 256))
    # hf_memo fits where plain HF ran out of memory, and computes the same loss
    minseq = {r["seq_len"]: r for r in rows.values() if r["contender"] == "minseq"}
    assert minseq[256]["status"] == "ok"
    assert minseq[256]["metrics"]["peak_allocated_bytes"] < hf[256]["metrics"]["peak_allocated_bytes"]
    assert minseq[32]["metrics"]["loss"] == pytest.approx(timed["metrics"]["loss"], rel=1e-2)
    # model FLOPs: LoRA base weights frozen (forward + input gradient), attention over the one sample of S tokens
    model = FlopModel(**timed["metrics"]["flop_model"])
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 224 + 2 * 64  # q, k, v, o, MLP, norms (tiny shape)
    adapters = 16 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 224))  # rank 16: A (r, in) + B (out, r)
    assert model == FlopModel(trainable=2 * adapters, frozen=2 * layer + 64 + 2048 * 64, layers=2, attention_width=64)
    assert timed["metrics"]["flops_per_step"] == model.flops(32, 32**2)
    assert timed["metrics"]["peak_flops"] is None and timed["metrics"]["mfu"] is None  # CPU: no known peak


def test_dry_run_reports_skipped_contenders_with_their_reason(dry_run):
    rows = _rows(dry_run)
    liger = rows[f"h200/{WORKLOAD}/hf+liger-flce/-"]
    assert liger["status"] == "skipped" and liger["reason"] == unavailable_reason(CONTENDERS["hf+liger-flce"], True)
    memo_rows = [r for r in rows.values() if r["contender"] == "memo-auto"]
    assert {r["seq_len"]: r["status"] for r in memo_rows}[32] == "ok"
    # memo's host pool (registered, not PyTorch's pinned allocator) is reported: empty here, where the dry run's
    # two layers are the two MEMO keeps on the device
    assert all(r["metrics"]["memo_host_bytes"] == 0 for r in memo_rows if r["status"] == "ok")
    assert not any(r["seq_len"] is not None for r in rows.values() if r["contender"] == "hf+liger-flce")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a pinned-memory allocator")
def test_a_contender_the_worker_finds_unavailable_is_skipped_after_one_launch(dry_run_with_log):
    out, log = dry_run_with_log
    rows = _rows(out)
    offload = rows[f"h200/{WORKLOAD}/hf+ckpt+offload/-"]
    assert offload["status"] == "skipped" and "pins host memory" in offload["reason"]
    assert not any(r["seq_len"] is not None for r in rows.values() if r["contender"] == "hf+ckpt+offload")
    assert log.count("hf+ckpt+offload: skipped") == 1


def test_dry_run_writes_the_table_with_commands_and_the_plots(dry_run):
    table = (dry_run / "h200.md").read_text()
    for row in _rows(dry_run).values():
        if row["seq_len"] is not None:
            assert f"`{row['command']}`" in table
    assert "- hf+liger-flce: " in table
    assert "| hf_memo contender |" in table  # the acceptance targets, for the LoRA workload
    assert "| unknown |" in table  # timed runs on a device without a known peak
    for name in ("h200-llama3-8b-lora.png", "h200-llama3.2-1b-full.png"):
        assert (dry_run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = table
    cli.main(["report", str(dry_run)])
    assert (dry_run / "h200.md").read_text() == before


def test_rerunning_resumes_without_running_anything_again(dry_run):
    before = _rows(dry_run)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite", "run", "h200", "--dry-run", "--out", str(dry_run)]
        + ["--workload", WORKLOAD, "--contender", "hf", "--contender", "minseq", "--seq-len", "32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert " timed: " not in done.stdout and " probe: " not in done.stdout
    after = _rows(dry_run)
    assert {k: r["finished_at"] for k, r in after.items() if "finished_at" in r} == {
        k: r["finished_at"] for k, r in before.items() if "finished_at" in r
    }


def test_an_error_and_a_crash_of_the_worker_are_recorded(tmp_path, monkeypatch):
    # (that a failed configuration does not stop the suite is shown by the dry run going on after its OOMs)
    monkeypatch.setenv(worker.FAULT_VARIABLE, "error")
    _run(tmp_path, "--contender", "hf", "--seq-len", "64")
    row = _rows(tmp_path)[f"h200/{WORKLOAD}/hf/64"]
    assert row["status"] == "error" and "injected by BENCH_SUITE_FAULT=error" in row["reason"]
    assert "Traceback" in row["reason"]
    monkeypatch.setenv(worker.FAULT_VARIABLE, "exit")
    _run(tmp_path, "--contender", "hf", "--seq-len", "64", "--force")
    crashed = _rows(tmp_path)[f"h200/{WORKLOAD}/hf/64"]
    assert crashed["status"] == "error" and "exited with code 3" in crashed["reason"]
    assert crashed["finished_at"] >= row["finished_at"]


def test_pinning_failures_and_killed_workers_are_not_device_oom_and_the_alloc_conf_is_the_contenders(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(ALLOC_CONF, "backend:cudaMallocAsync")  # the shell's, never inherited
    monkeypatch.setenv(worker.FAULT_VARIABLE, "pinned_oom")
    _run(tmp_path, "--contender", "hf", "--seq-len", "64")
    row = _rows(tmp_path)[f"h200/{WORKLOAD}/hf/64"]
    assert row["status"] == "pinned_oom" and "CUDA error: out of memory" in row["reason"]
    assert row["env"][ALLOC_CONF] == CONTENDERS["hf"].cuda_alloc_conf == "expandable_segments:True"
    monkeypatch.setenv(worker.FAULT_VARIABLE, "killed")
    _run(tmp_path, "--contender", "hf", "--seq-len", "64", "--force")
    row = _rows(tmp_path)[f"h200/{WORKLOAD}/hf/64"]
    assert row["status"] == "host_oom" and "SIGKILL" in row["reason"]
    assert fits_of([row]) == {64: None}  # says nothing about device memory


def test_timeouts_are_recorded_and_a_spent_budget_records_nothing(tmp_path):
    _run(tmp_path, "--contender", "hf", "--seq-len", "64", "--time-limit", "0.5")
    row = _rows(tmp_path)[f"h200/{WORKLOAD}/hf/64"]
    assert row["status"] == "timeout" and "killed after the 0.5 s limit" in row["reason"]
    _run(tmp_path, "--contender", "hf", "--seq-len", "96", "--budget", "0.5")
    assert f"h200/{WORKLOAD}/hf/96" not in _rows(tmp_path)


def test_dry_run_scale_maps_the_real_grid():
    real, dry = suite("h200").plan(dry_run=False), suite("h200").plan(dry_run=True)
    assert dry.grid == [s // DRY_RUN_SCALE for s in real.grid]
    assert dry.reference_length == real.reference_length // DRY_RUN_SCALE


def test_the_host_column_adds_memos_registered_bytes_to_pytorchs_pinned_peak():
    from benchmarks.suite.report import _host

    assert _host({"pinned_peak_bytes": 2 * 2**30, "memo_host_bytes": 6 * 2**30}, False).endswith(" pinned")
    assert _host({"pinned_peak_bytes": 2 * 2**30, "memo_host_bytes": 6 * 2**30}, False) == _host(
        {"pinned_peak_bytes": 8 * 2**30}, False
    )
    assert _host({"memo_host_bytes": 4096, "host_rss_before_bytes": 0, "host_rss_after_bytes": 1}, True).endswith(
        " host pool"
    )
