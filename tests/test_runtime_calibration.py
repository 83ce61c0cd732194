import math
import weakref

import torch

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.patches.layer_split import split_layer
from hf_memo.runtime import calibration
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.calibration import (
    _stashed_bytes,
    host_bandwidth,
    layer_bytes_per_token,
    layer_forward_seconds,
    snapped,
    time_layer_forward,
)
from hf_memo.runtime.offload import HostPool
from tests.conftest import ShapeRecorder, build_model


def _layer_input(seq=64):
    model = build_model("llama", num_hidden_layers=2)
    x = torch.randn(2, seq, 32, dtype=torch.float64, requires_grad=True) * 1.0
    split = split_layer(
        model.model.layers[0], x, position_embeddings=model.model.rotary_emb(x, torch.arange(seq)[None])
    )
    return split, x


def test_bytes_per_token_do_not_depend_on_the_probe_length():
    split, x = _layer_input()
    kept = layer_bytes_per_token(split, x, rows=16)
    assert kept == layer_bytes_per_token(split, x, rows=48)
    # layer input (32) and attention output (4 heads x 8) in fp64, + 4 fp64 softmax statistics
    assert (kept.input, kept.attention) == (32 * 8, 32 * 8 + 4 * 8) and kept.fixed == kept.input + kept.attention
    assert kept.other > kept.fixed  # norms, projections, RoPE and the MLP save more than input and output
    # a blocked backward's keys' and values' gradient sums (2 KV heads x (8 + 8), fp64) and the output alone
    kv_heads = split.layer.self_attn.config.num_key_value_heads
    assert (kept.key_sums, kept.output) == (kv_heads * 16 * 8, 4 * 8 * 8)


def test_probing_leaves_the_rng_and_no_references_behind():
    split, x = _layer_input()
    storage = weakref.ref(x.untyped_storage())
    torch.manual_seed(5)
    layer_bytes_per_token(split, x)
    time_layer_forward(split, x.detach(), chunk_bounds(x.shape[1], 4))
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))
    del x
    assert storage() is None  # freed at once: the probe's stash holds no graph that holds the stash


def test_timings_and_bandwidth_are_positive():
    split, x = _layer_input()
    assert time_layer_forward(split, x.detach(), chunk_bounds(x.shape[1], 3)).seconds > 0
    pool = HostPool(torch.device("cpu"))
    assert host_bandwidth(x, pool) > 0
    assert pool.in_use_bytes == 0 and pool.reserved_bytes == x.numel() * x.element_size()  # kept for the stash


class _ConstantSaver:
    """The layer's split, whose finish also saves one ``(B, 1, H)`` tensor: the same bytes at any length."""

    def __init__(self, split):
        self.split, self.traits = split, split.traits

    def project(self, x, start, stop):
        return self.split.project(x, start, stop)

    def finish(self, x, o, start):
        total = x.sum(dim=1, keepdim=True)
        return self.split.finish(x, o, start) + total * total

    def kept(self):
        return self.split.kept()


def test_per_token_bytes_leave_out_tensors_whose_size_does_not_grow_with_the_tokens():
    split, x = _layer_input()
    assert layer_bytes_per_token(_ConstantSaver(split), x, rows=32) == layer_bytes_per_token(split, x, rows=32)


def test_under_autocast_the_probe_stashes_only_per_token_bytes():
    model = build_model("llama", dtype=torch.float32)
    x = torch.randn(2, 40, 32)
    embeddings = model.model.rotary_emb(x, torch.arange(40)[None])
    split = split_layer(model.model.layers[0], x, position_embeddings=embeddings)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.enable_grad():
        short, long = _stashed_bytes(split, x, 10), _stashed_bytes(split, x, 40)
        kept = layer_bytes_per_token(split, x, rows=40)
    assert long == 4 * short  # nothing of constant size (the weights' bf16 casts) is stashed
    assert kept.fixed + kept.other == long / (2 * 40)


class _RecordingSplit:
    """Forwards to a layer split and logs the rows of every call."""

    def __init__(self, split, log):
        self.split, self.traits, self.log = split, split.traits, log

    def project(self, x, start, stop):
        self.log.append(("project", x.shape[1]))
        return self.split.project(x, start, stop)

    def finish(self, x, o, start):
        self.log.append(("finish", x.shape[1]))
        return self.split.finish(x, o, start)

    def kept(self):
        return self.split.kept()


class _RecordingCore:
    def __init__(self, log):
        self.log = log

    def forward(self, q, k, v, traits):
        self.log.append(("attention", q.shape[2]))
        return LocalAttention.forward(q, k, v, traits)


def test_timing_runs_the_executors_chunks_once_to_warm_up_then_times_them_and_keeps_the_fastest(monkeypatch):
    split, x = _layer_input(seq=50)
    log = []
    # Three timed runs, four clock reads each (start, around attention, end): the second is the fastest.
    clock = iter([0, 2, 4, 6, 10, 11, 12, 13, 20, 22, 23, 25])

    def perf_counter():
        log.append(("clock", None))
        return float(next(clock))

    monkeypatch.setattr(calibration.time, "perf_counter", perf_counter)
    bounds = chunk_bounds(50, 4)
    timing = time_layer_forward(_RecordingSplit(split, log), x.detach(), bounds, _RecordingCore(log))
    project = [("project", b - a) for a, b in bounds]
    finish = [("finish", b - a) for a, b in bounds]
    tick = [("clock", None)]
    warm_up = project + [("attention", 50)] + finish
    timed = tick + project + tick + [("attention", 50)] + tick + finish + tick
    assert calibration.TIMED_RUNS == 3 and log == warm_up + timed * 3
    assert timing.seconds == 3.0 and timing.attention_seconds == 1.0  # the fastest run; the attention core alone
    assert timing.workspace_bytes == 0  # CPU: no device memory counter


def test_timing_never_builds_a_full_length_mlp_intermediate():
    split, x = _layer_input(seq=64)
    with ShapeRecorder() as shapes:
        time_layer_forward(split, x.detach(), chunk_bounds(64, 4))
    widths = {s[-1] for s in shapes.shapes if len(s) == 3 and s[1] == 64}
    assert 72 not in widths and max(s[1] for s in shapes.shapes if len(s) == 3 and s[-1] == 72) == 16


def test_measurements_are_snapped_to_a_grid_of_eighth_octaves():
    assert snapped(1.0) == 1.0 and snapped(0.93) == snapped(0.95) == 2 ** (-1 / 8)
    assert snapped(3e9) == 2 ** (round(math.log2(3e9) * 8) / 8) and abs(snapped(3e9) / 3e9 - 1) < 0.045
    assert snapped(0.0) == 0.0


def test_layer_forward_seconds_times_chunks_of_at_most_chunk_tokens_rows(monkeypatch):
    split, x = _layer_input(seq=50)
    log = []
    monkeypatch.setattr(calibration.time, "perf_counter", iter(range(100)).__next__)
    seconds = layer_forward_seconds(_RecordingSplit(split, log), x.detach(), chunk_tokens=16)
    projected = [rows for kind, rows in log if kind == "project"]
    # ceil(50 / 16) = 4 chunks: a warm-up, then the timed runs
    assert projected == [b - a for a, b in chunk_bounds(50, 4)] * (1 + calibration.TIMED_RUNS)
    assert seconds == 3.0  # three timed intervals of one tick: projections, attention, the rest


def test_peak_allocated_keeps_the_highest_reading_after_any_op_and_resets_nothing():
    from hf_memo.runtime.calibration import PeakAllocated

    live = []
    with PeakAllocated(lambda: sum(t.numel() for t in live)) as peak:  # a stand-in for the allocator's counter
        live.append(torch.ones(100))
        live.append(torch.ones(50))
        torch.zeros(3)  # read after this op: 150 live
        live.clear()
        torch.zeros(3)
    assert peak.peak == 150
