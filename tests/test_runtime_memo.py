import contextlib
import copy
import dataclasses
import gc
import math
import re
import weakref

import pytest
import torch

import hf_memo
from hf_memo.config import MemoConfig
from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.patches.layer_split import split_layer
from hf_memo.planner.plan import MemoryPlan
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.planner.policy_solver import PolicyDoesNotFit
from hf_memo.runtime import memo as memo_module
from hf_memo.runtime.arena import ArenaWarning
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.calibration import TIMED_RUNS, LayerForward, layer_bytes_per_token
from hf_memo.runtime.memo import MemoRuntime
from hf_memo.runtime.offload import PlainMemory
from tests.conftest import assert_same_grads, build_model, make_batch
from tests.test_patches_packing import packed_row, padded_batch

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off", "deferred_copies")


def _on_host(policy):
    return sum(layer.on_host for layer in policy.layers)


def _split_and_input(seq=32):
    model = build_model("llama", num_hidden_layers=2)
    x = torch.randn(1, seq, 32, dtype=torch.float64)
    return split_layer(
        model.model.layers[0], x, position_embeddings=model.model.rotary_emb(x, torch.arange(seq)[None])
    ), x


def test_offload_plan_is_solved_once_per_shape_and_swaps_all_but_the_last_two_layers():
    runtime = MemoRuntime(MemoConfig(recompute="memo", offload_fraction=0.5), num_layers=6)
    split, x = _split_and_input()
    assert runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 8), LocalAttention, 0) == 4
    plan = runtime.plan
    assert _on_host(plan) == 4 and {layer.alpha for layer in plan.layers} == {0.5}
    assert runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 8), LocalAttention, 0) == 4 and runtime.plan is plan


def test_a_new_shape_is_solved_again_and_a_known_one_is_not():
    split, short = _split_and_input(seq=16)
    long_split, long = _split_and_input(seq=48)
    kept = layer_bytes_per_token(split, short)
    host = 4 * (kept.fixed + 0.5 * kept.other) * 16  # four layers at alpha 1/2 of the short shape
    runtime = MemoRuntime(
        MemoConfig(recompute="memo", offload_fraction=0.5, host_memory_limit=f"{math.ceil(host)}B"), 6
    )
    runtime.alpha_chunks(split, short, chunk_bounds(16, 4), LocalAttention, 0)
    first = runtime.plan
    assert _on_host(first) == 4 and first.layers[0].alpha == 0.5
    with pytest.warns(UserWarning, match="offload_fraction=0.5 needs more host memory"):
        runtime.alpha_chunks(long_split, long, chunk_bounds(48, 4), LocalAttention, 0)
    second = runtime.plan
    assert second is not first and second.bound == "host memory" and second.layers[0].alpha < 0.5
    runtime.alpha_chunks(split, short, chunk_bounds(16, 4), LocalAttention, 3)
    assert runtime.plan is first  # decided once per shape
    assert runtime.offload_for(1, 16).policy is first and runtime.offload_for(1, 48).policy is second


def test_an_assumed_policy_is_checked_and_runs_for_every_shape():
    runtime = MemoRuntime(MemoConfig(recompute="memo"), num_layers=3)
    with pytest.raises(ValueError, match="has 2 layer policies; the model has 3 decoder layers"):
        runtime.assume_policy(MemoryPolicy((LayerPolicy(),) * 2))
    with pytest.raises(ValueError, match=r"layer 1's policy has alpha=1.5; alpha must be in \[0, 1\]"):
        runtime.assume_policy(MemoryPolicy((LayerPolicy(), LayerPolicy(alpha=1.5), LayerPolicy())))
    policy = MemoryPolicy((LayerPolicy(False, True, 0.5), LayerPolicy(True, False, 1.0), LayerPolicy(False, False)))
    runtime.assume_policy(policy)
    assert runtime.assumed_policy is policy
    for seq in (16, 24):
        split, x = _split_and_input(seq)
        bounds = chunk_bounds(seq, 4)
        assert [runtime.alpha_chunks(split, x, bounds, LocalAttention, i) for i in range(3)] == [2, 4, 0]
        assert runtime.plan is policy
        stashes = [runtime.open_stash(i, x.device) for i in range(3)]
        assert [(s.keep_attention, s.swapped) for s in stashes] == [(False, True), (True, False), (False, False)]


# One policy of each kind: X only and X + attention, on the host and on the device, alpha 0, 1/2, 1 and
# fractions that are not whole chunks (1/3 and 0.7 of 4 chunks: 1 and 2 chunks).
MIXED = MemoryPolicy(
    (
        LayerPolicy(keep_attention=False, on_host=True, alpha=0.0),
        LayerPolicy(keep_attention=True, on_host=True, alpha=0.5),
        LayerPolicy(keep_attention=False, on_host=False, alpha=1.0),
        LayerPolicy(keep_attention=True, on_host=False, alpha=1 / 3),
        LayerPolicy(keep_attention=False, on_host=True, alpha=0.7),
        LayerPolicy(keep_attention=True, on_host=False, alpha=0.0),
    )
)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_mixed_policy_gives_the_unpatched_loss_and_gradients_over_steps_with_accumulation(family):
    model = build_model(family, **({"n_layer": 6} if family == "gpt2" else {"num_hidden_layers": 6}))
    reference = copy.deepcopy(model)
    hf_memo.apply(model, recompute="memo", mlp_chunks=4, lm_head_chunks=3)
    runtime = hf_memo.memo_runtime(model)
    runtime.assume_policy(MIXED)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(2):
        batches = [make_batch(2, 19, seed=10 * step + micro) for micro in range(2)]
        num_items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches)
        before = runtime.attention_calls
        for ids, labels in batches:  # two micro-batches accumulated, the loss normalised over both
            losses = [
                m(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(num_items)).loss
                for m in (model, reference)
            ]
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)  # HF's loss is float32
            for loss in losses:
                loss.backward()
        assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
        assert runtime.plan is MIXED and runtime.offload_for(2, 19).head_offloaded and runtime.host_reserved_bytes > 0
        assert runtime.attention_calls - before == 2 * (6 + 3)  # per micro-batch: 6 layers, 3 again in backward
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("keep_attention", [False, True])
def test_a_swapped_layer_arrives_in_pieces_no_larger_than_what_the_layer_above_gave_back(monkeypatch, keep_attention):
    """Every layer on the host: each layer's backward gives its keys' gradient sums back chunk by chunk, and the
    layer below fetches as many of its bytes as were given back, never more, in pieces joined when its own backward
    begins (a layer keeping its attention output reads that chunk by chunk from the host, outside the pieces); the
    gradients are the unpatched model's, over two accumulated micro-batches."""
    model = build_model("llama", num_hidden_layers=4)
    reference = copy.deepcopy(model)
    hf_memo.apply(model, recompute="memo", mlp_chunks=5, lm_head_chunks=3)
    hf_memo.memo_runtime(model).assume_policy(
        MemoryPolicy(tuple(LayerPolicy(keep_attention, True, 0.0) for _ in range(4)))
    )
    asked, fetched, stash_bytes, joined = {}, {}, {}, []
    prefetch, join = memo_module.LayerStash.prefetch, memo_module.LayerStash._join_pieces

    def recording_prefetch(stash, nbytes=None):
        prefetch(stash, nbytes)
        if nbytes is not None:  # the layer above gave ``nbytes`` back: at most that many are on their way
            asked.setdefault(stash.index, []).append(nbytes)
            fetched.setdefault(stash.index, []).append(sum(piece.numel() for _, piece in stash._pieces))
            assert fetched[stash.index][-1] <= nbytes
            stash_bytes[stash.index] = (stash._fetched_with_buffers, stash.nbytes)

    def recording_join(stash):
        joined.append(stash.index)
        join(stash)

    monkeypatch.setattr(memo_module.LayerStash, "prefetch", recording_prefetch)
    monkeypatch.setattr(memo_module.LayerStash, "_join_pieces", recording_join)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    seq = 23
    key_sums_bytes = 2 * 2 * config.num_key_value_heads * seq * head_dim * 8  # dk, dv; batch 2, fp64
    for micro in range(2):
        ids, labels = make_batch(2, seq, seed=micro)
        for m in (model, reference):
            m(input_ids=ids, labels=labels).loss.backward()
    assert_same_grads(model, reference)
    assert sorted(joined) == [0, 0, 1, 1, 2, 2]  # layers 0-2 are below another, once per micro-batch
    for index in range(3):
        # per micro-batch: nothing given back at the start, then one call per chunk
        assert len(asked[index]) == 2 * 6 and asked[index] == sorted(asked[index][:6]) * 2 and asked[index][0] == 0
        assert asked[index][5] == key_sums_bytes  # every chunk's sums given back by the end
        with_buffers, whole = stash_bytes[index]
        assert fetched[index][0] == 0 and fetched[index][5] == min(with_buffers, key_sums_bytes)  # as much as fits
        assert (with_buffers < whole) == keep_attention  # the attention output comes chunk by chunk instead


@pytest.mark.parametrize("batch", ["packed", "right-padded", "left-padded"])
def test_input_only_layers_recompute_per_sample_attention_exactly(batch):
    """Packed and padded rows attend per sample: an input-only layer recomputes that attention in backward."""
    reference = build_model("llama", num_hidden_layers=3)
    model = hf_memo.apply(copy.deepcopy(reference), recompute="memo", mlp_chunks=3, lm_head_chunks=2)
    runtime = hf_memo.memo_runtime(model)
    runtime.assume_policy(
        MemoryPolicy((LayerPolicy(False, True, 0.5), LayerPolicy(True, True, 1.0), LayerPolicy(False, False, 0.0)))
    )
    if batch == "packed":
        samples, labels, ids, packed_labels, positions, num_items = packed_row()
        model(input_ids=ids, labels=packed_labels, position_ids=positions, num_items_in_batch=num_items).loss.backward()
        for sample, label in zip(samples, labels):
            reference(input_ids=sample[None], labels=label[None], num_items_in_batch=num_items).loss.backward()
    else:
        ids, labels, mask = padded_batch(batch.split("-")[0])
        for m in (model, reference):
            m(input_ids=ids, labels=labels, attention_mask=mask).loss.backward()
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
    assert runtime.attention_calls == 3 + 2


def test_a_host_limit_too_small_for_any_layer_keeps_every_layer_on_the_device():
    runtime = MemoRuntime(MemoConfig(recompute="memo", offload_fraction=1.0, host_memory_limit="1000B"), num_layers=6)
    split, x = _split_and_input()
    with pytest.warns(UserWarning, match="holds the layer inputs and attention outputs of 0 of 4 layers"):
        runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), LocalAttention, 0)
    assert _on_host(runtime.plan) == 0


def test_auto_alpha_uses_the_given_bandwidth_and_layer_time():
    split, x = _split_and_input()
    fast = MemoRuntime(MemoConfig(recompute="memo", host_bandwidth=1e15, layer_time=1.0), num_layers=6)
    slow = MemoRuntime(MemoConfig(recompute="memo", host_bandwidth=1.0, layer_time=1e-9), num_layers=6)
    assert fast.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), LocalAttention, 0) == 4 and fast.plan.bound == "all"
    assert slow.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), LocalAttention, 0) == 0
    assert slow.plan.bound == "bandwidth"


def test_on_the_cpu_without_a_device_limit_nothing_is_timed_and_alpha_follows_from_bytes(monkeypatch):
    def untimed(*args):
        raise AssertionError("timed on the CPU without a device limit")

    monkeypatch.setattr(memo_module, "time_layer_forward", untimed)
    monkeypatch.setattr(memo_module, "host_bandwidth", untimed)
    split, x = _split_and_input()
    kept = layer_bytes_per_token(split, x)
    roomy = MemoRuntime(MemoConfig(recompute="memo"), num_layers=6)
    assert roomy.alpha_chunks(split, x, chunk_bounds(32, 4), LocalAttention, 0) == 4 and roomy.plan.bound == "all"
    host = 4 * (kept.fixed + 0.6 * kept.other) * 32  # four host layers at alpha 0.6: 0.5 on a grid of 4 chunks
    small = MemoRuntime(MemoConfig(recompute="memo", host_memory_limit=f"{math.ceil(host)}B"), num_layers=6)
    assert small.alpha_chunks(split, x, chunk_bounds(32, 4), LocalAttention, 0) == 2
    assert small.plan.bound == "host memory" and {layer.alpha for layer in small.plan.layers} == {0.5}


@pytest.mark.parametrize("chunks", [1, 4])
def test_the_policy_reports_the_alpha_the_executor_runs(chunks):
    split, x = _split_and_input()
    kept = layer_bytes_per_token(split, x)
    # The copy bound at alpha 0.9: T * B = S_in + S_attn + 0.9 S_other for the step's 32 tokens.
    bandwidth = (kept.fixed + 0.9 * kept.other) * 32 / 1.0
    runtime = MemoRuntime(MemoConfig(recompute="memo", layer_time=1.0, host_bandwidth=bandwidth), num_layers=6)
    offloaded = runtime.alpha_chunks(split, x, chunk_bounds(32, chunks), LocalAttention, 0)
    assert runtime.plan.bound == "bandwidth" and offloaded == {1: 0, 4: 3}[chunks]
    assert {layer.alpha for layer in runtime.plan.layers} == {offloaded / chunks}
    assert (
        runtime.plan.summary()
        == {1: "4 X+attn/host, 2 X+attn/device", 4: "4 X+attn/host (alpha 0.75), 2 X+attn/device (alpha 0.75)"}[chunks]
    )


def test_the_solver_is_told_what_a_blocked_backward_fetches_late(monkeypatch):
    """A host layer's stash comes ahead only as far as the keys' gradient sums of the layer above give memory back
    (its blocked backward), its kept output chunk by chunk: the costs the solver gets say so; with planned memory
    (the stash fetched whole ahead) they do not."""
    solved = []

    def recording(layers, costs, *args):
        solved.append(costs)
        return real(layers, costs, *args)

    real = memo_module.solve_policy
    monkeypatch.setattr(memo_module, "solve_policy", recording)
    split, x = _split_and_input()
    kept = layer_bytes_per_token(split, x)
    tokens = x.shape[0] * x.shape[1]  # 32 tokens: a bucket's longest length
    for planned, ahead, streamed in ((False, kept.key_sums * tokens, kept.output * tokens), (True, math.inf, 0.0)):
        config = MemoConfig(recompute="memo", device_memory_limit="1GiB", layer_time=1e-3, host_bandwidth=1e9)
        runtime = MemoRuntime(config, num_layers=6)
        runtime.planned_memory = planned
        runtime.alpha_chunks(split, x, chunk_bounds(32, 4), LocalAttention, 0)
        assert (solved[-1].ahead_bytes, solved[-1].streamed_bytes) == (ahead, streamed), planned
    assert 0 < kept.key_sums * tokens < math.inf


def test_measured_times_a_few_percent_apart_decide_the_same_policy(monkeypatch):
    """Timing noise (0.93 s against 0.95 s) falls on one grid point: both runs plan alike."""
    split, x = _split_and_input()
    kept = layer_bytes_per_token(split, x)
    bandwidth = (kept.fixed + 9 / 16 * kept.other) * 32 / 0.94  # the copy bound at 0.94 s: alpha 9/16, a grid edge
    policies = []
    for seconds in (0.93, 0.95):
        monkeypatch.setattr(memo_module, "time_layer_forward", lambda *args, s=seconds: LayerForward(s, 0, s / 4))
        runtime = MemoRuntime(MemoConfig(recompute="memo", host_bandwidth=bandwidth), num_layers=6)
        runtime.alpha_chunks(split, x, chunk_bounds(32, 16), LocalAttention, 0)
        policies.append(runtime.plan)
    assert policies[0] == policies[1] and policies[0].bound == "bandwidth"


def test_a_memory_plan_for_another_shape_is_not_used():
    runtime = MemoRuntime(MemoConfig(recompute="memo", offload_fraction=0.0, planner="greedy"), num_layers=6)
    runtime.attach_memory_plan(MemoryPlan("x", 512, 0, 0, [], [], {}, 0, {}, {}, meta={"batch_size": 1, "seq_len": 8}))
    split, x = _split_and_input()
    with pytest.warns(ArenaWarning, match="no memory plan for batch 1 x 32 tokens"):
        runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), LocalAttention, 0)
    assert runtime.memory_plan is None


def _memo_model(layers=4, **config):
    model = build_model("llama", num_hidden_layers=layers)
    return hf_memo.apply(model, recompute="memo", mlp_chunks=4, **{"offload_fraction": 0.5, **config})


def _sealed_stashes(monkeypatch) -> list:
    sealed = []
    original = MemoRuntime.sealed

    def spy(self, index, stash):
        sealed.append(weakref.ref(stash))
        original(self, index, stash)

    monkeypatch.setattr(MemoRuntime, "sealed", spy)
    return sealed


def test_an_aborted_step_keeps_no_stash_alive_and_the_next_step_is_exact(monkeypatch):
    model = _memo_model()
    reference = copy.deepcopy(model)
    hf_memo.revert(reference)
    sealed = _sealed_stashes(monkeypatch)
    ids, labels = make_batch(2, 16)
    loss = model(input_ids=ids, labels=labels).loss  # backward never runs
    assert len(sealed) == 4 and all(ref() is not None for ref in sealed)
    del loss
    gc.collect()
    assert all(ref() is None for ref in sealed)  # the top layers' device stashes went with the graph
    sealed.clear()
    with monkeypatch.context() as patch:
        patch.setattr(model.lm_head, "forward", lambda hidden: 1 / 0)
        with contextlib.suppress(ZeroDivisionError):
            model(input_ids=ids, labels=labels)
    gc.collect()
    assert len(sealed) == 4 and all(ref() is None for ref in sealed)
    model(input_ids=ids, labels=labels).loss.backward()
    reference(input_ids=ids, labels=labels).loss.backward()
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def test_host_buffers_of_an_old_shape_are_freed_on_a_new_one():
    model = _memo_model(layers=5)
    runtime = hf_memo.memo_runtime(model)
    model(input_ids=make_batch(2, 48)[0], labels=make_batch(2, 48)[1]).loss.backward()
    long = runtime.host_reserved_bytes
    model(input_ids=make_batch(2, 16)[0], labels=make_batch(2, 16)[1]).loss.backward()
    fresh = _memo_model(layers=5)
    fresh(input_ids=make_batch(2, 16)[0], labels=make_batch(2, 16)[1]).loss.backward()
    assert 0 < runtime.host_reserved_bytes == hf_memo.memo_runtime(fresh).host_reserved_bytes < long


def test_steps_of_nearby_lengths_reuse_the_host_buffers_and_stay_exact(monkeypatch):
    """Variable-length batches (as padding-free training has): a step a little shorter than the longest so far
    allocates no host buffer; one longer allocates, and the next step frees what it outgrew."""
    model = _memo_model(layers=5)
    reference = copy.deepcopy(model)
    hf_memo.revert(reference)
    runtime = hf_memo.memo_runtime(model)
    allocated = []
    original = PlainMemory.allocate
    monkeypatch.setattr(PlainMemory, "allocate", lambda memory, n: allocated.append(n) or original(memory, n))
    reserved, allocations = [], []
    for seq in (40, 44, 40, 42, 44):
        ids, labels = make_batch(2, seq, seed=seq)
        for m in (model, reference):
            m.zero_grad()
            m(input_ids=ids, labels=labels).loss.backward()
        assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
        reserved.append(runtime.host_reserved_bytes)
        allocations.append(len(allocated))
    assert allocations[0] > 0 and allocations[1] > allocations[0]  # the first and the longer step allocate
    assert allocations[1] == allocations[2] == allocations[3] == allocations[4]  # the others reuse
    assert reserved[1] > reserved[0] and reserved[1] == reserved[2] == reserved[3] == reserved[4]


def test_a_device_memory_limit_hands_the_policy_to_the_solver_and_auto_has_none_on_cpu(monkeypatch):
    timed = memo_module.time_layer_forward

    def steady(*args, **kwargs):  # attention's timed share pinned: what the solver trades is bytes, not noise
        return dataclasses.replace(timed(*args, **kwargs), seconds=1.0, attention_seconds=0.1)

    monkeypatch.setattr(memo_module, "time_layer_forward", steady)
    split, x = _split_and_input()
    kept = layer_bytes_per_token(split, x)
    tokens = x.shape[0] * x.shape[1]
    everything = (kept.fixed + kept.other) * tokens  # a layer's stash at alpha 1, keeping attention
    config = dict(recompute="memo", host_bandwidth=1e15, layer_time=1.0)
    bounds = chunk_bounds(x.shape[1], 8)
    free = MemoRuntime(MemoConfig(**config), num_layers=6)
    assert free.alpha_chunks(split, x, bounds, LocalAttention, 0) == 8 and free._device_limit(x.device) is None
    assert _on_host(free.plan) == 4 and free.plan.bound == "all"  # no device limit: MEMO's LP and layout
    roomy = MemoRuntime(MemoConfig(**config, device_memory_limit=f"{math.ceil(6 * everything)}B"), num_layers=6)
    roomy.alpha_chunks(split, x, bounds, LocalAttention, 0)
    assert roomy.plan.layers == (LayerPolicy(True, False, 1.0),) * 6 and roomy.plan.bound == "all"
    assert not roomy.offload_for(1, 32).head_offloaded  # no layer on the host: neither is the LM head's input
    tight = 2 * kept.input * tokens + 2 * (kept.fixed + 0.5 * kept.other) * tokens  # 2 device X + 2 buffers
    limited = MemoRuntime(MemoConfig(**config, device_memory_limit=f"{math.ceil(tight)}B"), num_layers=6)
    limited.alpha_chunks(split, x, bounds, LocalAttention, 0)
    plan = limited.plan
    assert plan.device_bytes <= tight and plan.predicted_step_seconds is not None
    assert _on_host(plan) == 4 and plan.bound == "device memory" and limited.offload_for(1, 32).head_offloaded
    assert not any(layer.keep_attention for layer in plan.layers if not layer.on_host)  # the device keeps X only


def _gradient_bytes(model):
    """Bytes of the gradients a step allocates: the device budget leaves them out."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _tight_memo_model(device_layers_x_only, **config):
    """A 6-layer llama under memo whose device budget holds, beside the gradients, ``device_layers_x_only`` layer
    inputs of a 2 x 19 step (host bandwidth and layer time given, so nothing is timed against the machine's load)."""
    input_bytes = 2 * 19 * 32 * 8  # B * S * hidden * float64
    model = build_model("llama", num_hidden_layers=6)
    reference = copy.deepcopy(model)
    limit = device_layers_x_only * input_bytes + _gradient_bytes(model)
    limits = dict(device_memory_limit=f"{limit}B", host_bandwidth=1e9, layer_time=1e-3)
    hf_memo.apply(model, recompute="memo", mlp_chunks=4, lm_head_chunks=3, **{**limits, **config})
    # the solver's own accounting is under test (sizing: test_integrations_policy_sizing)
    hf_memo.memo_runtime(model).sizer = None
    return model, reference, input_bytes


def test_a_tight_device_budget_keeps_inputs_only_and_gives_the_unpatched_gradients(monkeypatch, caplog):
    """Room for four layer inputs: two device layers and the two copy buffers, so every layer keeps X only,
    alpha 0, and the four lowest go to the host; the stashes are the bytes the solver counted."""
    caplog.set_level("INFO", logger="hf_memo.runtime.memo")
    model, reference, input_bytes = _tight_memo_model(4)
    runtime = hf_memo.memo_runtime(model)
    sealed, original = {}, MemoRuntime.sealed

    def spy(self, index, stash):
        sealed[index] = stash.nbytes  # aligned to 512 bytes: a layer input here is 19 x 512
        original(self, index, stash)

    monkeypatch.setattr(MemoRuntime, "sealed", spy)
    for step in range(2):
        batches = [make_batch(2, 19, seed=10 * step + micro) for micro in range(2)]
        num_items = torch.tensor(sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches))
        for ids, labels in batches:
            for m in (model, reference):
                m(input_ids=ids, labels=labels, num_items_in_batch=num_items).loss.backward()
            assert [sealed.pop(index) for index in range(6)] == [input_bytes] * 6
        assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
        model.zero_grad()
        reference.zero_grad()
    expected = (LayerPolicy(False, True, 0.0),) * 4 + (LayerPolicy(False, False, 0.0),) * 2
    assert runtime.plan.layers == expected and runtime.plan.device_bytes == 4 * input_bytes
    assert runtime.attention_calls == 4 * 2 * 6  # four micro-batches, attention again in every backward
    logged = [r.getMessage() for r in caplog.records if r.name == "hf_memo.runtime.memo"]
    assert len(logged) == 1 and "(2, 19, 32): 4 X/host, 2 X/device (bound: device memory, " in logged[0]


def test_a_budget_that_cannot_hold_the_layer_inputs_fails_before_the_step_naming_the_shortfall():
    model, _, input_bytes = _tight_memo_model(3)
    ids, labels = make_batch(2, 19)
    with pytest.raises(PolicyDoesNotFit, match=r"at 38 tokens per step: no memory policy fits") as raised:
        model(input_ids=ids, labels=labels)
    assert raised.value.device_shortfall == input_bytes and raised.value.host_shortfall == 0
    assert "MemoConfig.device_memory_limit" in str(raised.value)
    assert hf_memo.memo_runtime(model).attention_calls == 0
    fitting = int(re.search(r"about (\d+) tokens per step would fit", str(raised.value)).group(1))
    assert 0 < fitting < 38
    ids, labels = make_batch(1, fitting, seed=3)  # a step of that many tokens fits
    model(input_ids=ids, labels=labels).loss.backward()


def test_calibration_times_attention_through_the_layers_own_core():
    """Under sequence parallelism the core exchanges heads for the sequence: the timed layer must include it."""
    calls = []

    class ExchangingCore:
        def forward(self, q, k, v, traits):
            calls.append(q.shape)
            return LocalAttention.forward(q, k, v, traits)

    split, x = _split_and_input()
    runtime = MemoRuntime(MemoConfig(recompute="memo", host_bandwidth=1e9), num_layers=6)
    runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), ExchangingCore(), 0)
    assert len(calls) == 1 + TIMED_RUNS and calls[0][2] == x.shape[1]  # warm-up and timed calls, whole sequence


def _sequence_parallel_solve(rank, world):
    """One step of a 4-layer llama split over 2 ranks, each rank told a different host bandwidth: alone, the slow
    rank would keep its layers on the device and the fast one send them to the host."""
    bandwidth = 1e15 if rank == 0 else 1e3
    model = build_model("llama", num_hidden_layers=4)
    limits = dict(
        device_memory_limit=f"{6 * 2 * 8 * 32 * 8 + _gradient_bytes(model)}B",
        host_bandwidth=bandwidth,
        layer_time=1e-3,
    )
    hf_memo.apply(model, recompute="memo", mlp_chunks=2, sequence_parallel_size=2, **limits)
    hf_memo.memo_runtime(model).sizer = None  # the ranks' agreement is under test, with the solver's own accounting
    ids, labels = make_batch(2, 16)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        torch.distributed.all_reduce(grad := param.grad.clone())
        grads[name] = grad / world
    return {"policy": hf_memo.memo_runtime(model).plan, "loss": loss.detach(), "grads": grads}


def test_sequence_parallel_ranks_agree_on_one_policy_and_match_one_process():
    from tests.multiprocess import run_processes

    results = run_processes(_sequence_parallel_solve, 2)
    assert results[0]["policy"] == results[1]["policy"]
    reference = build_model("llama", num_hidden_layers=4)
    ids, labels = make_batch(2, 16)
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    for result in results:
        torch.testing.assert_close(result["loss"], want.detach(), rtol=1e-6, atol=0)
        for name, param in reference.named_parameters():
            torch.testing.assert_close(result["grads"][name], param.grad, rtol=1e-8, atol=1e-11, msg=name)


def test_gradients_to_come_are_kept_out_of_the_budget_and_the_optimizer_state_is_counted_after_its_first_step(
    monkeypatch,
):
    """Budget for twelve layer inputs beside the gradients: the first step keeps more than X. After the first
    optimizer step its state takes device memory (stood in for by eight layer inputs in use): the shape is decided
    again, once, with every layer keeping X only; every step stays exact."""
    model, reference, input_bytes = _tight_memo_model(12)
    runtime = hf_memo.memo_runtime(model)
    in_use = {"bytes": 0}
    monkeypatch.setattr(memo_module, "_device_in_use", lambda device: in_use["bytes"])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    policies = []
    for step in range(3):
        ids, labels = make_batch(2, 19, seed=step)
        for m in (model, reference):
            m(input_ids=ids, labels=labels).loss.backward()
        assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
        policies.append(runtime.plan)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        in_use["bytes"] = 8 * input_bytes  # the momentum buffers, from the first optimizer step on
    assert any(layer.keep_attention or layer.alpha > 0 for layer in policies[0].layers)
    assert policies[1] is not policies[0] and policies[2] is policies[1]  # decided again once, then kept
    assert policies[1].layers == (LayerPolicy(False, True, 0.0),) * 4 + (LayerPolicy(False, False, 0.0),) * 2


@pytest.mark.filterwarnings("ignore::hf_memo.runtime.arena.ArenaWarning")  # the stand-in plan places nothing
def test_steps_of_varying_length_in_one_bucket_decide_plan_and_pin_once(monkeypatch):
    """Dynamic padding: ten steps of lengths 993-1008 (one length bucket) decide the memory policy, plan memory
    and register host buffers on the first step only; a step of another bucket decides and plans again."""
    reference = build_model("llama", num_hidden_layers=4)
    model = hf_memo.apply(
        copy.deepcopy(reference), recompute="memo", offload_fraction=0.5, mlp_chunks=4, lm_head_chunks=2
    )
    runtime = hf_memo.memo_runtime(model)
    solved, planned, registered = [], [], []
    solve = MemoRuntime._solve
    monkeypatch.setattr(MemoRuntime, "_solve", lambda self, *a: solved.append(a[1].shape[1]) or solve(self, *a))
    runtime._planner = lambda batch, seq, offload: (
        planned.append(seq)
        or MemoryPlan(
            "x",
            512,
            0,
            0,
            [],
            [],
            {},
            0,
            {},
            {},
            meta={"batch_size": batch, "seq_len": seq, "offload": offload.to_dict()},
        )
    )
    runtime.config = runtime.config.replace(planner="greedy")
    allocate = PlainMemory.allocate
    monkeypatch.setattr(PlainMemory, "allocate", lambda self, n: registered.append(n) or allocate(self, n))
    lengths = [1000, 1008, 993, 1005, 999, 1001, 1007, 994, 1003, 996]
    for step, seq in enumerate(lengths):
        ids, labels = make_batch(1, seq, seed=step)
        model(input_ids=ids, labels=labels).loss.backward()
        if step == 0:
            first_step_registrations = len(registered)
    assert solved == [1000] and planned == [1008]  # the bucket's longest length
    assert first_step_registrations > 0 and len(registered) == first_step_registrations
    for m in (model, reference):
        m.zero_grad()
    ids, labels = make_batch(1, 1009, seed=99)  # the next bucket (1009-1024)
    for m in (model, reference):
        m(input_ids=ids, labels=labels).loss.backward()
    assert solved == [1000, 1009] and planned == [1008, 1024]
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def test_a_host_limit_smaller_than_the_swap_set_keeps_the_rest_on_the_device_with_one_warning():
    """A policy that puts every layer on the host, and a host limit that holds about two layers' stashes: the
    layers the host cannot take keep their stash on the device, one warning says so, the pool stays within the
    limit and the gradients are the unpatched model's."""
    from hf_memo.runtime.offload import HostMemoryWarning

    reference = build_model("llama", num_hidden_layers=6)
    probe = hf_memo.apply(copy.deepcopy(reference), recompute="memo", mlp_chunks=3, lm_head_chunks=2)
    everything_on_host = MemoryPolicy((LayerPolicy(True, True, 1.0),) * 6)
    hf_memo.memo_runtime(probe).assume_policy(everything_on_host)
    ids, labels = make_batch(2, 24)
    probe(input_ids=ids, labels=labels).loss.backward()
    per_layer = hf_memo.memo_runtime(probe).host_reserved_bytes // 7  # six layers and the LM head's input
    limit = int(2.5 * per_layer)
    model = hf_memo.apply(
        copy.deepcopy(reference), recompute="memo", mlp_chunks=3, lm_head_chunks=2, host_memory_limit=f"{limit}B"
    )
    runtime = hf_memo.memo_runtime(model)
    runtime.assume_policy(everything_on_host)
    with pytest.warns(HostMemoryWarning, match="activations stay on the device") as caught:
        for _ in range(2):
            model(input_ids=ids, labels=labels).loss.backward()
    assert len([w for w in caught if w.category is HostMemoryWarning]) == 1
    assert 0 < runtime.host_reserved_bytes <= limit
    for _ in range(2):
        reference(input_ids=ids, labels=labels).loss.backward()
    assert_same_grads(model, reference, rtol=1e-9, atol=1e-12)


def test_gradients_to_come_count_this_ranks_partition_of_a_zero3_parameter():
    whole = torch.nn.Parameter(torch.zeros(6))
    partitioned = torch.nn.Parameter(torch.empty(0))  # ZeRO-3's placeholder outside its module's call
    partitioned.ds_tensor = torch.zeros(10)  # this rank's partition
    frozen = torch.nn.Parameter(torch.zeros(100), requires_grad=False)
    runtime = MemoRuntime(MemoConfig(recompute="memo"), 1, parameters=lambda: [whole, partitioned, frozen])
    assert runtime._gradients_to_come(torch.device("cpu")) == (6 + 10) * 4


def _agree_worker(rank, world):
    from hf_memo.runtime.calibration import LayerBytes
    from hf_memo.runtime.memo import StepMeasurements, _agreed

    measured = StepMeasurements(
        num_layers=4,
        tokens=64,
        chunks=4,
        per_token=LayerBytes(1.0, 2.0, 3.0),
        layer_seconds=1e-3 * (rank + 1),
        attention_seconds=1e-4,
        bandwidth=1e9 / (rank + 1),
        host_budget=1e9,
        device_budget=1e8 + rank,
        requested_alpha=None,
        device_limit=[2_000_000_000, 1_500_000_000][rank],  # NCCL buffers, context: every rank its own
        device_in_use=[300_000_000, 350_000_000][rank],
    )
    return _agreed(measured, torch.distributed.group.WORLD, torch.device("cpu"))


def test_sequence_parallel_ranks_size_their_policy_with_one_limit_and_one_memory_in_use():
    """The sizer re-solves with the device limit and the memory in use: ranks that differ there would size other
    policies and make other all-to-alls. Agreed: the lowest limit, the most memory in use, as every other input."""
    from tests.multiprocess import run_processes

    first, second = run_processes(_agree_worker, 2)
    assert first == second
    assert first.device_limit == 1_500_000_000 and first.device_in_use == 350_000_000
    assert first.layer_seconds == 2e-3 and first.bandwidth == 5e8 and first.device_budget == 1e8


def _stash_storage_frees(monkeypatch, batch, seq):
    """A fake-tensor profile of one memo step of a 4-layer Llama, layers 0 and 1 on the host: the trace, and for
    each swapped layer the phase of every free of its stash's device storages."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from transformers import LlamaConfig

    from hf_memo.profiler.allocations import AllocationRecorder
    from hf_memo.profiler.fake_model import fake_causal_lm
    from hf_memo.profiler.step import trace_training_step
    from tests.conftest import TINY_LAYOUT

    model, session = fake_causal_lm(LlamaConfig(**{**TINY_LAYOUT, "num_hidden_layers": 4}), torch.bfloat16)
    with session:
        hf_memo.apply(model, recompute="memo", mlp_chunks=2, lm_head_chunks=2)
    hf_memo.memo_runtime(model).assume_policy(MemoryPolicy(tuple(LayerPolicy(True, i < 2, 0.5) for i in range(4))))
    stashed, seal = {}, memo_module.LayerStash.seal

    def recording_seal(stash):
        if stash.swapped:  # the recorder's ids of the device storages the seal copies to the host
            recorder = next(m for m in _get_current_dispatch_mode_stack() if isinstance(m, AllocationRecorder))
            stashed[stash.index] = [recorder._ids[whole.untyped_storage()] for whole in stash._storages]
        seal(stash)

    monkeypatch.setattr(memo_module.LayerStash, "seal", recording_seal)
    with session:
        trace = trace_training_step(model, batch, seq, kernels="cpu")
    freed = {event.tensor_id: event.phase for event in trace.events if event.op == "free"}
    return trace, {index: {freed[i] for i in ids} for index, ids in stashed.items()}


def test_a_fake_profile_counts_a_swapped_stash_until_the_next_layer_seals(monkeypatch):
    """The estimator and the policy sizer read fake-tensor profiles of the runtime's own allocations. A swapped
    layer's copies to the host may still run after its seal (on CUDA), reading its device tensors: the stash holds
    them until the next layer seals (its copies waited on then), so the profile counts that stash in flight, not
    freed at its seal."""
    _, frees = _stash_storage_frees(monkeypatch, 2, 64)
    # (the embeddings, layer 0's input, are also the backbone's until its forward ends; index 4 is the head's input)
    assert {index: phases - {"head"} for index, phases in frees.items() if index < 4} == {
        0: {"layer 1 forward"},
        1: {"layer 2 forward"},
    }
