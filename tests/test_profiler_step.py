import itertools

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, LlamaConfig

import hf_memo
from hf_memo.profiler.analysis import peak, unfreed
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.memtracker import peak_of
from hf_memo.profiler.step import steady_optimizer, token_batch, trace_training_step, training_step

CONFIGS = {
    "llama": lambda layers=2: LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        max_position_embeddings=1 << 14,
    ),
    "gpt2": lambda layers=2: GPT2Config(
        n_embd=64, n_layer=layers, n_head=4, vocab_size=500, n_positions=1 << 12, bos_token_id=1, eos_token_id=2
    ),
}
MODES = ("vanilla", "checkpointing", "minseq")


def build(family, mode, lora=False, layers=2):
    model, session = fake_causal_lm(CONFIGS[family](layers), torch.bfloat16)
    with session:
        if lora:
            with session.converting_modules():
                model = get_peft_model(model, LoraConfig(r=4, task_type="CAUSAL_LM"))
        if mode != "vanilla":
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if mode == "minseq":
            hf_memo.apply(model, min_chunk_tokens=128)
    return model, session


def nbytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("optimizer", ["adamw", "none"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_peak_agrees_with_memtracker_under_the_same_fake_mode(family, mode, optimizer):
    model, session = build(family, mode)
    with session:
        trace = trace_training_step(model, 1, 512, optimizer, kernels="cpu")  # MemTracker sees the CPU kernel's
    model, session = build(family, mode)
    with session:
        opt = steady_optimizer(model, optimizer)
        ids = token_batch(model, 1, 512)
        reference = peak_of(lambda: training_step(model, ids, opt), model, ids, *([opt] if opt else []))
    ours = peak(trace)
    assert ours.total == reference.total
    for category in ("parameter", "buffer", "optimizer"):
        assert ours.by_category[category] == getattr(reference, category), category
    # MemTracker also counts an incoming gradient it sees in a hook before it is copied into .grad as
    # a gradient; we count only what ends up in .grad, so the gradient split may differ, not the total.
    assert ours.by_category["gradient"] <= reference.gradient


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("optimizer", ["adamw", "none"])
def test_every_malloc_is_freed_or_reported_live_and_the_live_ones_are_the_state(optimizer, lora):
    model, session = build("llama", "minseq", lora=lora)
    with session:
        trace = trace_training_step(model, 2, 384, optimizer)
        opt = steady_optimizer(model, optimizer)  # a second optimizer with the same state layout
    live = unfreed(trace)
    assert live == trace.meta["live_at_end"]
    live_bytes = {e.category: 0 for e in trace.events}
    sizes = {e.tensor_id: e for e in trace.events if e.op == "malloc"}
    for tensor_id in live:
        live_bytes[sizes[tensor_id].category] += sizes[tensor_id].size
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert live_bytes["parameter"] == nbytes(model.parameters())
    assert live_bytes["buffer"] == nbytes(model.buffers())
    assert live_bytes["activation"] == 2 * 384 * 8  # only the int64 input ids outlive the step
    assert live_bytes.get("temporary", 0) == 0
    if optimizer == "adamw":
        assert live_bytes["optimizer"] == nbytes(t for state in opt.state.values() for t in state.values())
        assert live_bytes.get("gradient", 0) == 0
    else:
        assert live_bytes["gradient"] == nbytes(trainable)
    frees = [e for e in trace.events if e.op == "free"]
    assert all(sizes[e.tensor_id].size == e.size and sizes[e.tensor_id].category == e.category for e in frees)


@pytest.mark.parametrize("mode", MODES)
def test_phases_follow_the_step_in_order(mode):
    model, session = build("llama", mode, layers=3)
    with session:
        trace = trace_training_step(model, 1, 256)
    runs = [phase for phase, _ in itertools.groupby(e.phase for e in trace.events)]
    assert runs == [
        "other",
        "embedding",
        "layer 0 forward",
        "layer 1 forward",
        "layer 2 forward",
        "head",
        "layer 2 backward",
        "layer 1 backward",
        "layer 0 backward",
        "embedding",
        "optimizer",
    ]
    assert {e.category for e in trace.events if e.phase == "optimizer"} == {"gradient"}  # fused AdamW: no scratch
    starts = trace.meta["stage_starts"]
    assert 0 < starts["forward"] < starts["backward"] < starts["optimizer"] < starts["other"] <= len(trace.events)
    assert trace.events[starts["forward"]].phase == "embedding"
    assert trace.events[starts["optimizer"]].phase == "optimizer"
    assert all(e.phase != "optimizer" for e in trace.events[: starts["optimizer"]])


def test_recomputation_under_checkpointing_belongs_to_the_layers_backward():
    mallocs = {}
    for mode in ("vanilla", "checkpointing"):
        model, session = build("llama", mode, layers=3)
        with session:
            trace = trace_training_step(model, 1, 256)
        mallocs[mode] = {
            (direction, category): sum(
                e.size
                for e in trace.events
                if e.op == "malloc"
                and e.phase == f"layer 1 {direction}"
                and (category is None or e.category == category)
            )
            for direction in ("forward", "backward")
            for category in (None, "activation")
        }
    # a checkpointed layer keeps only its output (S, H) from forward ...
    assert mallocs["checkpointing"][("forward", "activation")] == 256 * 64 * 2
    # ... and its forward runs again in its backward (all but the last ops, which are not needed)
    recomputed = mallocs["checkpointing"][("backward", None)] - mallocs["vanilla"][("backward", None)]
    forward = mallocs["checkpointing"][("forward", None)]
    assert 0.9 * forward <= recomputed <= forward
