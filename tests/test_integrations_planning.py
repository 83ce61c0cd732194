import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch._subclasses.fake_tensor import is_fake

import hf_memo
from hf_memo.integrations.planning import plan_training_step
from hf_memo.patches.apply import memo_runtime
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.runtime import memo
from hf_memo.runtime.calibration import LayerForward
from hf_memo.runtime.memo import MemoRuntime
from tests.conftest import assert_same_grads, build_model, make_batch

BUFFERS = {"prefetch 0", "prefetch 0.1", "prefetch 1", "prefetch 1.1"}  # per slot: the layer input, the rest


def _memo_model(**overrides):
    model = build_model("llama", num_hidden_layers=5)
    return hf_memo.apply(model, recompute="memo", offload_fraction=0.5, mlp_chunks=4, planner="greedy", **overrides)


def test_plan_covers_the_executor_buffers_and_keeps_the_running_and_prefetched_stashes_apart():
    plan = plan_training_step(_memo_model(), 2, 16, progress=False)
    assert (plan.meta["batch_size"], plan.meta["seq_len"]) == (2, 16)
    assert set(plan.arena_offsets) == BUFFERS
    # A layer's backward reads its own prefetch buffer while the one below is fetched into the other: they are
    # alive together, so the plan lays them side by side; nothing else of the executor is in the arena.
    assert plan.arena_size == sum(plan.arena_sizes.values())


def test_planning_a_lora_model_profiles_the_adapters_too():
    model = get_peft_model(_memo_model(), LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    plan = plan_training_step(model, 1, 16, progress=False)
    assert set(plan.arena_offsets) == BUFFERS


def test_planning_a_lora_model_with_trainable_copies_of_modules():
    def plan(**saved):
        lora = LoraConfig(r=4, target_modules=["q_proj"], **saved)
        return plan_training_step(get_peft_model(_memo_model(), lora), 1, 16, progress=False)

    with_copies = plan(modules_to_save=["embed_tokens", "norm"])
    assert set(with_copies.arena_offsets) == BUFFERS
    # The copies of the embedding and the norms, and their gradients, are in the profiled step.
    assert with_copies.lower_bound > plan().lower_bound


def test_training_with_the_planner_serves_buffers_from_the_arena_and_stays_exact():
    model = _memo_model()
    reference = copy.deepcopy(model)
    hf_memo.revert(reference)
    runtime = memo_runtime(model)
    for seed in (1, 2):
        model.zero_grad()
        reference.zero_grad()
        ids, labels = make_batch(2, 16, seed=seed)
        model(input_ids=ids, labels=labels).loss.backward()
        reference(input_ids=ids, labels=labels).loss.backward()
        assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
    assert runtime.memory_plan is not None and runtime.memory_plan.meta["seq_len"] == 16
    transport = next(iter(runtime._transports.values()))
    arena = transport.prefetch.arena
    assert arena is not None and arena.planned and arena.buffer.numel() == runtime.memory_plan.arena_size


def test_a_new_shape_is_planned_again():
    model = _memo_model()
    runtime = memo_runtime(model)
    model(input_ids=make_batch(1, 16)[0], labels=make_batch(1, 16)[1]).loss.backward()
    first = runtime.memory_plan
    model(input_ids=make_batch(1, 24)[0], labels=make_batch(1, 24)[1]).loss.backward()
    assert runtime.memory_plan is not first and runtime.memory_plan.meta["seq_len"] == 24


def test_planning_needs_a_patched_model():
    with pytest.raises(ValueError, match="needs a model patched by hf_memo.apply"):
        plan_training_step(build_model("llama"), 1, 8)
    assert torch.is_grad_enabled()


def test_the_plan_is_made_for_the_offload_the_real_model_solved(monkeypatch):
    # Fake tensors' timings mean nothing: here a fake layer "takes" no time, so a profiling copy left to
    # solve alpha itself would offload nothing, while the real layer (1 s, unlimited bandwidth) offloads all.
    monkeypatch.setattr(
        memo, "time_layer_forward", lambda split, x, bounds, core: LayerForward(0.0 if is_fake(x) else 1.0, 0, 0.0)
    )
    seen = []
    original = MemoRuntime.alpha_chunks

    def spy(self, split, x, bounds, core, index):
        chunks = original(self, split, x, bounds, core, index)
        seen.append((is_fake(x), chunks))
        return chunks

    monkeypatch.setattr(MemoRuntime, "alpha_chunks", spy)
    model = hf_memo.apply(
        build_model("llama", num_hidden_layers=5), recompute="memo", mlp_chunks=4, planner="greedy", host_bandwidth=1e15
    )
    runtime = memo_runtime(model)
    early = plan_training_step(model, 2, 16, progress=False)  # before the real model ran: the copy's own alpha
    assert {layer["alpha"] for layer in early.meta["offload"]["layers"]} == {0.0}
    runtime.attach_memory_plan(early)
    seen.clear()
    ids, labels = make_batch(2, 16)
    model(input_ids=ids, labels=labels).loss.backward()
    assert runtime.memory_plan is not early  # planned again, for the real offload
    assert runtime.memory_plan.meta["offload"] == {
        "layers": [{"keep_attention": True, "on_host": index < 3, "alpha": 1.0} for index in range(5)],
        "bound": "all",
        "head_offloaded": True,
    }
    assert {chunks for fake, chunks in seen if fake} == {chunks for fake, chunks in seen if not fake} == {4}


def test_the_profiling_copy_runs_the_policy_the_real_model_assumes():
    model = _memo_model()
    runtime = memo_runtime(model)
    policy = MemoryPolicy(
        (
            LayerPolicy(keep_attention=False, on_host=True, alpha=0.5),
            LayerPolicy(keep_attention=True, on_host=True, alpha=0.0),
            LayerPolicy(keep_attention=False, on_host=False, alpha=1.0),
            LayerPolicy(keep_attention=True, on_host=True, alpha=0.25),
            LayerPolicy(keep_attention=True, on_host=False, alpha=0.0),
        )
    )
    runtime.assume_policy(policy)
    early = plan_training_step(model, 2, 16, progress=False)  # before the real model ran: the assumed policy
    layers = [{"keep_attention": p.keep_attention, "on_host": p.on_host, "alpha": p.alpha} for p in policy.layers]
    assert early.meta["offload"]["layers"] == layers
    runtime.attach_memory_plan(early)
    model(input_ids=make_batch(2, 16)[0], labels=make_batch(2, 16)[1]).loss.backward()
    assert runtime.plan is policy and runtime.memory_plan is early  # made for what the real step ran: kept
