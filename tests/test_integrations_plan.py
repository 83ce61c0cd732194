import subprocess
import sys

import pytest

from hf_memo.integrations import cli
from hf_memo.integrations.plan import AllocatorComparison, profile_step, summary
from hf_memo.planner.bilevel import plan_fingerprint, plan_memory
from hf_memo.planner.lifetimes import Trace
from hf_memo.planner.plan import MemoryPlan
from hf_memo.planner.solution import check_placement
from tests.test_profiler_step import CONFIGS

LAYERS = 5  # memo keeps two layers on the device and fetches through two buffers: 5 layers have every kind
BUFFERS = {"prefetch 0", "prefetch 0.1", "prefetch 1", "prefetch 1.1"}  # per slot: the layer input, the rest


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    CONFIGS["llama"](LAYERS).save_pretrained(folder)
    return str(folder / "config.json")


@pytest.fixture(scope="module")
def memo_trace(config_path):
    return profile_step(config_path, 64, mode="memo")


def test_a_step_is_profiled_at_full_depth_with_the_estimator_modes(memo_trace, config_path):
    phases = {e.phase for e in memo_trace.events}
    assert {f"layer {i} {d}" for i in range(LAYERS) for d in ("forward", "backward")} <= phases
    assert (memo_trace.meta["layers"], memo_trace.meta["seq_len"], memo_trace.meta["mode"]) == (LAYERS, 64, "memo")
    assert {e.name for e in memo_trace.events if e.name is not None} == BUFFERS
    checkpointed = profile_step(config_path, 64, batch_size=2, mode="hf-checkpointing", optimizer="none")
    assert checkpointed.meta["batch_size"] == 2
    assert not any(e.name for e in checkpointed.events)  # plain Hugging Face owns no hf_memo buffers
    assert not any(e.phase == "optimizer" for e in checkpointed.events)


def test_cli_plans_a_profiled_step_prints_every_level_and_saves_a_valid_plan(tmp_path, capsys, config_path, memo_trace):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", config_path, "--seq-len", "64", "--mode", "memo", "--out", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    for label in ("5 layers", "batch 1 x 64 tokens, mode memo", "lower bound", "level 1 layer 0 forward", "level 2"):
        assert label in text, text
    assert "Arena for hf_memo's own buffers" in text and "prefetch 0:" in text and "prefetch 1:" in text
    assert "without a plan:" in text and "hf_memo's buffers in the arena:" in text
    assert "every tensor at its planned offset:" in text and f"Plan saved to {out}" in text

    plan = MemoryPlan.load(out)
    assert plan.fingerprint == plan_fingerprint(memo_trace)  # the step the command profiled is this one
    assert set(plan.arena_offsets) == BUFFERS and plan.meta["seq_len"] == 64
    assert check_placement(Trace.from_allocations(memo_trace), plan.offsets(), plan.alignment) == plan.peak
    assert plan.peak >= plan.lower_bound
    assert all(level["optimal"] for level in plan.stats["level1"])


def test_cli_plans_a_saved_trace_as_the_library_does(tmp_path, capsys, memo_trace):
    path = tmp_path / "step.jsonl"
    memo_trace.save(path)
    argv = [
        "plan",
        "--trace",
        str(path),
        "--solver",
        "greedy",
        "--alignment",
        "4KiB",
        "--out",
        str(tmp_path / "p.json"),
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "read from a file" in text and "(greedy)" in text
    expected = plan_memory(memo_trace, solver="greedy", alignment=4096, progress=False)
    saved = MemoryPlan.load(tmp_path / "p.json")
    assert (saved.peak, saved.offsets()) == (expected.peak, expected.offsets())
    assert saved.arena_offsets == expected.arena_offsets and saved.alignment == 4096


def test_the_allocator_comparison_serves_owned_buffers_from_the_arena(memo_trace):
    plan = plan_memory(memo_trace, solver="greedy", progress=False)
    comparison = AllocatorComparison.of(memo_trace, plan)
    device = [e for e in memo_trace.events if e.location == "device"]
    live, most = 0, 0
    for event in device:
        if event.name is None:
            live += event.size if event.op == "malloc" else -event.size
            most = max(most, live)
    # Everything but the owned buffers is requested as before; the arena is requested once, for the whole step.
    assert comparison.with_arena.peak_requested == most + plan.arena_size
    assert comparison.without_plan.peak_requested == max(Trace.from_allocations(memo_trace).live_bytes())
    assert set(comparison.to_dict()) == {"without_plan", "with_arena"}
    used = comparison.with_arena.peak_reserved <= comparison.without_plan.peak_reserved
    assert plan.arena_used == used and plan.stats["allocator"] == {
        "reserved": comparison.without_plan.peak_reserved,
        "reserved_with_arena": comparison.with_arena.peak_reserved,
    }
    plan.arena_used = False
    assert "(more: the runtime would not use the arena" in summary(memo_trace, plan, comparison, 0.0)
    assert "the runtime places only" not in summary(memo_trace, plan, comparison, 0.0)
    plan.peak = comparison.without_plan.peak_reserved + 512  # e.g. a level the solver left at the greedy's peak
    assert "(more than the caching allocator; the runtime places only hf_memo's buffers)" in summary(
        memo_trace, plan, comparison, 0.0
    )


def _malformed(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"op": "malloc", "id": 1, "bytes": 512}\n{"op": "free", "id": 1, "bytes": 1024}\n')
    return str(path)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "llama-9b", "--seq-len", "1k"], "unknown model 'llama-9b'; built-in models are gpt-7b"),
        (["--model", "llama-3-8b", "--seq-len", "0"], "--seq-len: a token count must be positive"),
        (["--model", "llama-3-8b", "--seq-len", "1k", "--batch", "0"], "--batch must be an integer >= 1"),
        (["--model", "llama-3-8b", "--seq-len", "1k", "--mode", "fast"], "--mode must be one of hf, hf-check"),
        (["--model", "llama-3-8b", "--seq-len", "1k", "--solver", "ilp"], "--solver must be one of cpsat, greedy"),
        (["--model", "llama-3-8b", "--seq-len", "1k", "--time-limit", "0"], "--time-limit must be a number of sec"),
        (["--model", "llama-3-8b", "--seq-len", "1k", "--time-limit", "soon"], "got 'soon'"),
        (["--model", "llama-3-8b", "--seq-len", "1k", "--alignment", "0"], "--alignment must be at least 1 byte"),
        (["--model", "llama-3-8b", "--seq-len", "1k", "--alignment", "big"], "--alignment: expected a size such as"),
        (["--model", "llama-3-8b", "--seq-len", "1k", "--alignment", "512"], "--alignment: 512 has no unit: write"),
        (["--model", "llama-3-8b", "--seq-len", "1k", "--dtype", "int8"], "--dtype must be one of bf16, fp16, fp32"),
        (["--model", "llama-3-8b"], "give --model and --seq-len (or --trace with a saved trace)"),
        (["--trace", "step.jsonl", "--model", "llama-3-8b"], "give either --trace or --model with --seq-len"),
        (["--trace", "/nonexistent/step.jsonl"], "No such file or directory"),
        (["--trace", "MALFORMED"], "size mismatch, tensor 1 was allocated with 512 bytes, freed with 1024"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    argv = [_malformed(tmp_path) if item == "MALFORMED" else item for item in argv]
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hf-memo plan: error: ") and message in err, err


def test_gpt2_past_its_learned_positions_is_refused(tmp_path):
    CONFIGS["gpt2"](2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="learned positions for at most 4,096 tokens, got seq_len 8,192"):
        profile_step(str(tmp_path / "config.json"), 8192)


def test_the_command_exits_2_without_a_traceback():
    command = [sys.executable, "-m", "hf_memo.integrations.cli", "plan", "--model", "llama-3-8b", "--seq-len", "x"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "hf-memo plan: error: --seq-len: expected a token count such as '4096', '128k' or '1M', got 'x'"
    ]
