import pytest
import torch

from hf_memo.config import MemoConfig
from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.patches.llama import FAMILY
from hf_memo.planner.plan import MemoryPlan
from hf_memo.runtime.arena import ArenaWarning
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.memo import MemoRuntime
from tests.conftest import build_model


def _split_and_input(seq=32):
    model = build_model("llama", num_hidden_layers=2)
    x = torch.randn(1, seq, 32, dtype=torch.float64)
    return FAMILY.split(model.model.layers[0], model.model.rotary_emb(x, torch.arange(seq)[None])), x


def test_offload_plan_is_solved_once_per_shape_and_swaps_all_but_the_last_two_layers():
    runtime = MemoRuntime(MemoConfig(recompute="memo", offload_fraction=0.5), num_layers=6)
    split, x = _split_and_input()
    assert runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 8), LocalAttention) == 4
    plan = runtime.plan
    assert plan.swapped_layers == 4 and plan.alpha == 0.5
    assert runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 8), LocalAttention) == 4 and runtime.plan is plan


def test_a_host_limit_too_small_for_any_layer_keeps_every_layer_on_the_device():
    runtime = MemoRuntime(MemoConfig(recompute="memo", offload_fraction=1.0, host_memory_limit=1000), num_layers=6)
    split, x = _split_and_input()
    with pytest.warns(UserWarning, match="holds the layer inputs and attention outputs of 0 of 4 layers"):
        runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), LocalAttention)
    assert runtime.plan.swapped_layers == 0


def test_auto_alpha_uses_the_given_bandwidth_and_layer_time():
    split, x = _split_and_input()
    fast = MemoRuntime(MemoConfig(recompute="memo", host_bandwidth=1e15, layer_time=1.0), num_layers=6)
    slow = MemoRuntime(MemoConfig(recompute="memo", host_bandwidth=1.0, layer_time=1e-9), num_layers=6)
    assert fast.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), LocalAttention) == 4 and fast.plan.bound == "all"
    assert (
        slow.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), LocalAttention) == 0 and slow.plan.bound == "bandwidth"
    )


def test_a_memory_plan_for_another_shape_is_not_used():
    runtime = MemoRuntime(MemoConfig(recompute="memo", offload_fraction=0.0, planner="greedy"), num_layers=6)
    runtime.attach_memory_plan(MemoryPlan("x", 512, 0, 0, [], [], {}, 0, {}, {}, meta={"batch_size": 1, "seq_len": 8}))
    split, x = _split_and_input()
    with pytest.warns(ArenaWarning, match="no memory plan for batch 1 x 32 tokens"):
        runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), LocalAttention)
    assert runtime.memory_plan is None
