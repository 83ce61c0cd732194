"""One rank's memory in a multi-GPU job: DeepSpeed's model states, the Ulysses all-to-all buffers (checked against
hf_memo's own Ulysses core run under a fake process group), reserves and the host budget, and the flags."""

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from hf_memo.estimator.cluster import (
    DEVICE_RESERVE,
    HOST_RESERVE_NODE,
    HOST_RESERVE_PER_RANK,
    PINNABLE_FRACTION,
    Cluster,
    DeepSpeedConfig,
    all_to_all_bytes,
)
from hf_memo.estimator.estimate import estimate
from hf_memo.estimator.model_states import (
    ModelStates,
    model_states,
    rank_budget,
    rank_peak,
    rank_state_bytes,
    rank_states,
)
from hf_memo.integrations import cli
from hf_memo.parallel.memo_attention import UlyssesAttention
from hf_memo.profiler.allocations import AllocationRecorder
from hf_memo.profiler.analysis import Peak, peak
from hf_memo.profiler.shapes import builtin_config
from hf_memo.profiler.trace import CATEGORIES
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.attention_traits import AttentionTraits

GiB = 2**30
P = 8_000_000_000  # a Llama-3-8B-sized model: 32 layers of 218M, embedding and LM head of 525M elements
STATES = ModelStates(P, P, 2, 525_000_000, 525_000_000, 525_000_000, persistent=300_000)


@pytest.fixture(scope="module")
def llama_8b():
    return model_states(builtin_config("llama-3-8b"), torch.bfloat16, "full", "adamw", Cluster())


def test_the_model_states_of_llama_3_8b(llama_8b):
    assert llama_8b.parameters == llama_8b.trainable == 8_030_261_248
    assert llama_8b.element_size == 2
    assert llama_8b.largest_region == llama_8b.largest_parameter == 128_256 * 4096  # the embedding, the LM head
    assert llama_8b.persistent == 65 * 4096  # 64 layer norms and the final norm stay whole on every rank
    lora = model_states(builtin_config("llama-3-8b"), torch.bfloat16, "lora", "adamw", Cluster())
    assert lora.parameters > llama_8b.parameters and 0 < lora.trainable < llama_8b.parameters // 1000


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_optimizer_offload_keeps_16_bytes_per_parameter_on_the_host_plus_bf16_staging(zero):
    one = rank_states(STATES, Cluster(zero=zero, offload_optimizer=True))
    # fp32 master weights 4 + fp32 gradients 4 + AdamW's two fp32 moments 8, and DeepSpeed's bf16 staging buffer 2
    staging = 2 * STATES.largest_parameter if zero < 3 else 0  # ZeRO-1/2: one gradient on its way to the host
    assert one.host == 18 * P + staging and one.host >= 16 * P
    assert one.host_pageable == 8 * P  # the moments; the rest is pinned (DeepSpeed's pin_memory default)
    assert one.optimizer == 0
    eight = rank_states(STATES, Cluster(8, 8, zero, True))
    assert eight.host == 18 * P // 8 + staging
    unpinned = rank_states(STATES, Cluster(8, 8, zero, True, deepspeed=DeepSpeedConfig(pin_memory=False)))
    assert unpinned.host_pinned == 0 and unpinned.host == eight.host
    pure = rank_states(STATES, Cluster(8, 8, zero, True, deepspeed=DeepSpeedConfig(pure_bf16=True)))
    assert pure.host == 10 * P // 8 + staging  # bf16 master weights, gradients, moments and staging


def test_without_offload_the_master_weights_and_moments_are_on_the_device():
    two = rank_states(STATES, Cluster(8, 8, 2))
    assert two.parameters == 2 * P and two.gathered == 0
    assert two.optimizer == 12 * P // 8
    bucket = 500_000_000 * 2
    assert two.buckets == bucket  # overlap_comm is off by default under ZeRO-2
    assert two.gradients == 2 * P // 8 + 2 * STATES.largest_region_trainable + bucket
    assert two.gradients_before_backward == 0  # the bucket and the partition come with the first gradient
    assert two.step_gradients == (2 + 4) * P // 8  # the bf16 partition and its fp32 copy at the step
    assert rank_states(STATES, Cluster(8, 8, 2, deepspeed=DeepSpeedConfig(overlap_comm=True))).buckets == 2 * bucket
    one = rank_states(STATES, Cluster(8, 8, 1))
    assert one.gradients == 2 * P + bucket  # ZeRO-1 keeps every gradient until the step
    assert two.host == one.host == 0


def test_zero3_gathers_the_running_region_and_its_prefetch_up_to_the_live_limit():
    three = rank_states(STATES, Cluster(8, 8, 3))
    region = STATES.largest_region
    prefetch = min(50_000_000 + STATES.largest_parameter, 1_000_000_000 - region)
    assert three.gathered == 2 * (region + prefetch) == 2 * 1_000_000_000  # stage3_max_live_parameters binds
    partition = (P - STATES.persistent) // 8
    assert three.parameters == 2 * (partition + STATES.persistent) + three.gathered
    bucket = 500_000_000 * 2
    assert three.buckets == bucket  # one, overlap_comm or not
    assert three.gradients_before_backward == 2 * P // 8 + bucket  # allocated once, alive in the forward too
    assert three.gradients == three.gradients_before_backward + 2 * STATES.largest_region_trainable
    assert three.optimizer == 12 * P // 8 + 4 * min(P // 8, 1_000_000_000)  # the fp32 buffer of a sub-group
    small = rank_states(STATES, Cluster(8, 8, 3, deepspeed=DeepSpeedConfig(max_live_parameters=0)))
    assert small.gathered == 2 * region  # no room to prefetch: the running region only
    tiny = ModelStates(1000, 1000, 2, 400, 400, 300, persistent=200)
    assert rank_states(tiny, Cluster(8, 8, 3)).gathered == 2 * 800  # never more than the partitioned parameters
    whole = rank_states(ModelStates(1000, 1000, 2, 400, 400, 300, persistent=1000), Cluster(8, 8, 3))
    assert whole.parameters == 2 * 1000 and whole.gathered == 0  # every parameter under the threshold: none split


GRADIENT_PEAK = Peak(
    100 * GiB,
    {
        "parameter": 16 * GiB,
        "buffer": 0,
        "gradient": 15 * GiB,
        "optimizer": 32 * GiB,
        "activation": 30 * GiB,
        "temporary": 7 * GiB,
    },
)


def test_rank_peak_puts_deepspeed_states_in_the_profile_and_keeps_the_rest():
    cluster = Cluster(8, 8, 3, True)
    device, host = rank_peak(GRADIENT_PEAK, STATES, cluster, extra_temporary=GiB)
    states = rank_states(STATES, cluster)
    assert host == states.host
    assert device.by_category["parameter"] == states.parameters
    assert device.by_category["gradient"] == states.gradients  # the profile peaks in backward
    assert device.by_category["optimizer"] == 0
    assert device.by_category["activation"] == 30 * GiB and device.by_category["temporary"] == 8 * GiB
    assert device.total == sum(device.by_category.values())
    forward = Peak(GRADIENT_PEAK.total, {**GRADIENT_PEAK.by_category, "gradient": 0}, phase="head")
    assert rank_peak(forward, STATES, cluster)[0].by_category["gradient"] == states.gradients_before_backward
    plain, none = rank_peak(GRADIENT_PEAK, STATES, Cluster(8, 8), extra_temporary=GiB)
    assert none == 0 and plain.total == 101 * GiB  # no ZeRO: the profile's own states


def test_the_highest_moment_is_chosen_with_a_rank_s_states_not_the_profile_s():
    """A profile holds full gradients and AdamW moments on the device from backward on, a DeepSpeed rank far less:
    its backward moment peaks in the profile, but on the rank the forward moment with more activations is higher.
    Replacing the states after choosing the profile's highest moment misses it (the estimator did, 2026-11-26)."""
    cluster = Cluster(1, 1, 2, True)
    states = rank_states(STATES, cluster)
    columns = {c: i for i, c in enumerate(CATEGORIES)}
    forward = np.zeros(len(CATEGORIES), dtype=np.int64)
    forward[[columns["parameter"], columns["optimizer"], columns["activation"]]] = (16 * GiB, 32 * GiB, 40 * GiB)
    backward = forward.copy()
    backward[[columns["gradient"], columns["activation"]]] = (15 * GiB, 30 * GiB)
    moments = np.stack([forward, backward])
    assert moments.sum(axis=1).argmax() == 1  # the profile's own highest: backward
    restated = rank_state_bytes(moments, STATES, cluster)
    assert restated.sum(axis=1).argmax() == 0  # the rank's: forward
    assert restated[0, columns["gradient"]] == states.gradients_before_backward
    assert restated[1, columns["gradient"]] == states.gradients
    assert (restated[:, columns["activation"]] == moments[:, columns["activation"]]).all()
    assert (rank_state_bytes(moments, STATES, Cluster(1, 1)) == moments).all()  # no ZeRO: the profile's own
    chosen = Peak(int(restated[0].sum()), {c: int(v) for c, v in zip(CATEGORIES, restated[0])})
    device, _ = rank_peak(chosen, STATES, cluster, restated=True)
    assert device.by_category == chosen.by_category  # not replaced twice


def test_the_optimizer_step_is_the_peak_when_activations_are_small():
    small = Peak(GiB, {"parameter": 0, "buffer": 0, "gradient": 1, "optimizer": 0, "activation": GiB, "temporary": 0})
    device, _ = rank_peak(small, STATES, Cluster(zero=2))
    assert device.phase == "optimizer step"
    assert device.total == 2 * P + 12 * P + (2 + 4) * P  # the DeepSpeed estimator's 2 + 18 bytes per parameter


# -- the Ulysses all-to-all ---------------------------------------------------------------------------------------


def _extra_peak(call, *held):
    """Bytes ``call`` allocates beyond ``held`` at its peak (the allocation recorder of the fake profiles)."""
    recorder = AllocationRecorder(lambda: "attention", lambda: "backward")
    with recorder:
        recorder.track(held)
        start = peak(recorder.trace()).total
        call()
    return peak(recorder.trace()).total - start


def _sequence_major(batch, seq_len, heads, head_dim):
    """``(B, h, s, D)`` views of ``(B, s, h, D)`` memory: how the memo executor hands q, k, v and gradients over."""
    return torch.randn(batch, seq_len, heads, head_dim, dtype=torch.bfloat16).transpose(1, 2)


def _core_peaks(core, batch, heads, kv_heads, seq_len, head_dim):
    q, out, grad = (_sequence_major(batch, seq_len, heads, head_dim) for _ in range(3))
    k, v = (_sequence_major(batch, seq_len, kv_heads, head_dim) for _ in range(2))
    traits = AttentionTraits(0.25)
    forward = _extra_peak(lambda: core.forward(q, k, v, traits), q, k, v)
    _, stats = core.forward(q, k, v, traits)
    backward = _extra_peak(lambda: core.backward(grad, q, k, v, out, stats, traits), grad, q, k, v, out, stats.lse)
    return forward, backward


@pytest.mark.parametrize(
    "batch,heads,kv_heads,sp",
    [
        (b, *shape)
        for b, shape in itertools.product(
            (1, 2),
            # degrees that divide the heads; uneven splits: 3 heads at sp=2, a GQA group straddling ranks (6 heads in
            # 2 groups at sp=4), KV heads repeated after the exchange (10 in 2 groups at sp=3, 28 in 4 at sp=8)
            [(8, 8, 4), (8, 2, 4), (8, 2, 8), (8, 1, 4), (4, 4, 4), (3, 3, 2), (6, 2, 4), (10, 2, 3), (28, 4, 8)],
        )
    ],
)
def test_all_to_all_bytes_are_what_the_real_ulysses_core_allocates(fake_world, batch, heads, kv_heads, sp):
    head_dim, rank_seq_len = 16, 32
    group = fake_world(sp)
    local = _core_peaks(LocalAttention(), batch, heads, kv_heads, rank_seq_len, head_dim)
    ulysses = _core_peaks(UlyssesAttention(group, sp), batch, heads, kv_heads, rank_seq_len, head_dim)
    extra = max(u - one for u, one in zip(ulysses, local))
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
    assert all_to_all_bytes(config, Cluster(sp, sp), batch, rank_seq_len, 2) == extra


@pytest.mark.parametrize("rank", [1, 2, 5, 7])
def test_rank_0_of_an_uneven_split_holds_the_most(fake_world, rank):
    """28 query heads in 4 groups over 8 ranks (Qwen2.5-7B's): 4 or 3 query heads each, KV heads repeated; the
    model counts rank 0's buffers, the most any rank holds (what the estimator's profiles of rank 0 see)."""
    group = fake_world(8, rank)
    local = _core_peaks(LocalAttention(), 2, 28, 4, 16, 8)
    ulysses = _core_peaks(UlyssesAttention(group, 8), 2, 28, 4, 16, 8)
    config = LlamaConfig(hidden_size=28 * 8, num_attention_heads=28, num_key_value_heads=4)
    assert max(u - one for u, one in zip(ulysses, local)) <= all_to_all_bytes(config, Cluster(8, 8), 2, 16, 2)


def test_all_to_all_bytes_count_all_positions_of_a_ranks_heads_once():
    config = builtin_config("llama-3-8b")  # 32 heads of 128, 8 kv heads
    assert all_to_all_bytes(config, Cluster(8, 1), 1, 1024, 2) == 0
    rank_seq_len, s = 1024, 8 * 1024  # the rank's positions and the whole sequence's
    exchanged = (2 * 4 + 2 * 1) * 128 * s * 2  # q and the output: 4 heads, k and v: 1 head, all S positions, bf16
    a2a = all_to_all_bytes(config, Cluster(8, 8), 1, rank_seq_len, 2)
    assert a2a >= exchanged  # the bug divided these by K once more: 8x too small
    # at the core's backward: the output's gradient, q, the output and dq (4 of q's size) and k, v, dk, dv (one KV
    # head each: 1 of q's size), less the single-GPU core's dq, dk, dv on the rank's positions (1.5 of q's size)
    assert a2a == 7 * (4 * 128 * s * 2) // 2
    assert all_to_all_bytes(config, Cluster(8, 8), 1, 2 * rank_seq_len, 2) == 2 * a2a  # linear in the tokens


def test_cluster_values_are_checked():
    assert Cluster(16, 8).ranks_per_node == 8 and Cluster(2).ranks_per_node == 2
    assert Cluster(8, 8).rank_seq_len(1000) == 125
    with pytest.raises(ValueError, match="zero must be one of 0, 1, 2, 3, got 5"):
        Cluster(zero=5)
    with pytest.raises(ValueError, match="sequence_parallel must divide num_gpus"):
        Cluster(8, 3)
    with pytest.raises(ValueError, match="zero must be 1, 2 or 3"):
        Cluster(offload_optimizer=True)
    assert "ZeRO-3, DeepSpeed pure bf16" in Cluster(8, 8, 3, deepspeed=DeepSpeedConfig(pure_bf16=True)).describe()


# -- reserves and budgets -----------------------------------------------------------------------------------------


def test_the_budget_subtracts_the_reserves_and_deepspeeds_pinned_states():
    cluster = Cluster(8, 8, 3, True)
    ranked = rank_states(STATES, cluster)
    budget = rank_budget(80 * GiB, 1024 * GiB, 600 * GiB, 3 * GiB, 40 * GiB, cluster, ranked)
    assert budget.device == 77 * GiB
    assert budget.host == 984 * GiB / 8
    assert budget.pinned == 600 * GiB / 8 - ranked.host_pinned
    assert budget.stash_room(ranked.host) == min(984 * GiB / 8 - ranked.host, budget.pinned)
    assert rank_budget(80 * GiB, None, None, 0, 0, Cluster(), None).host is None
    with pytest.raises(ValueError, match=r"reserve \(80.00 GiB\) must be less than gpu_memory \(80.00 GiB\)"):
        rank_budget(80 * GiB, None, None, 80 * GiB, 0, Cluster(), None)
    with pytest.raises(ValueError, match=r"host_reserve \(2.00 TiB\) must be less than host_memory"):
        rank_budget(80 * GiB, 1024 * GiB, None, 0, 2048 * GiB, Cluster(), None)


def test_the_command_line_reserves_3_gib_of_each_gpu_and_host_memory_per_node_by_default(capsys, tmp_path):
    from tests.test_profiler_step import CONFIGS

    CONFIGS["llama"](6).save_pretrained(tmp_path)
    argv = ["estimate", "--model", str(tmp_path / "config.json"), "--seq-len", "1k", "--host-memory", "64GiB"]
    argv += ["--num-gpus", "2", "--modes", "minseq", "--no-search", "--json"]

    def answer(*flags):
        assert cli.main(argv + list(flags)) == 0
        return json.loads(capsys.readouterr().out)

    first = answer("--gpu-memory", "80GiB")
    assert first["reserve"] == DEVICE_RESERVE == 3 * GiB
    assert first["host_reserve"] == HOST_RESERVE_NODE + 2 * HOST_RESERVE_PER_RANK
    assert first["pinned_memory"] == int(PINNABLE_FRACTION * (64 * GiB - first["host_reserve"]))
    peak_bytes = first["modes"]["minseq"]["footprint"]["device"]["total"]
    gpu = f"{peak_bytes + DEVICE_RESERVE - 2**20}B"  # room for the step, or for the reserve, not both
    assert not answer("--gpu-memory", gpu)["modes"]["minseq"]["fits"]
    assert answer("--gpu-memory", gpu, "--reserve", "0GiB")["modes"]["minseq"]["fits"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--reserve", "3 apples"], "--reserve: expected a size such as '80GiB'"),
        (["--reserve", "90GB"], "--reserve (83.82 GiB) must be less than --gpu-memory (80.00 GiB)"),
        (["--host-reserve", "lots"], "--host-reserve: expected a size"),
        (["--host-reserve", "2TiB"], "--host-reserve (2.00 TiB) must be less than --host-memory (1.00 TiB)"),
        (["--pure-bf16"], "--offload-optimizer and --pure-bf16 are DeepSpeed ZeRO settings: they need --zero 1, 2"),
        (["--offload-optimizer"], "they need --zero 1, 2 or 3"),
    ],
)
def test_bad_memory_flags_exit_2_with_one_line(capsys, extra, message):
    argv = ["estimate", "--model", "llama-3-8b", "--gpu-memory", "80GiB", "--host-memory", "1TiB", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_the_table_states_the_reserves_deepspeeds_states_and_the_host_limit_to_set(capsys, tmp_path):
    from tests.test_profiler_step import CONFIGS

    CONFIGS["llama"](6).save_pretrained(tmp_path)
    argv = ["estimate", "--model", str(tmp_path / "config.json"), "--seq-len", "1k", "--gpu-memory", "4GiB"]
    argv += ["--host-memory", "64GiB", "--host-reserve", "8GiB", "--reserve", "1GiB", "--num-gpus", "2"]
    argv += ["--sequence-parallel", "2", "--zero", "3", "--offload-optimizer", "--modes", "minseq", "--json"]
    assert cli.main(argv + ["--no-search"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["reserve"] == GiB and record["host_reserve"] == 8 * GiB
    assert record["host_per_rank"] == 28 * GiB  # (64 - 8) GiB over the node's 2 ranks
    assert record["pinned_memory"] == int(PINNABLE_FRACTION * 56 * GiB)
    states = record["states"]
    assert states["host_pinned"] + states["host_pageable"] > 0 and states["optimizer"] == 0
    # the memo limit: the rank's host share less DeepSpeed's states, or its pinnable share less DeepSpeed's pinned
    pinned_room = PINNABLE_FRACTION * 56 * GiB / 2 - states["host_pinned"]
    limit = min(28 * GiB - states["host_pinned"] - states["host_pageable"], pinned_room)
    assert record["host_memory_limit"] == int(limit)
    found = estimate(
        str(tmp_path / "config.json"),
        "1k",
        "4GiB",
        "64GiB",
        modes=["minseq"],
        search=False,
        progress=False,
        cluster=Cluster(2, 2, 3, True),
        reserve="1GiB",
        host_reserve="8GiB",
    )
    table = replace(found, modes={**found.modes, "memo": found.modes["minseq"]}).table()
    assert "Reserved: 1.00 GiB of each GPU" in table and "8.00 GiB of each node's host memory" in table
    assert "DeepSpeed model states per GPU (fp32 master weights, gradients and AdamW moments;" in table
    assert "Host memory assumed per GPU: 28.00 GiB" in table
    assert 'set MemoConfig(host_memory_limit="' in table and "2 ranks of a node would over-commit" in table
