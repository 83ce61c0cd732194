"""Under a device limit, the policy the runtime picks by itself fits when profiled directly (the runtime running it)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import hf_memo
from hf_memo.integrations.policy_sizing import twin_preparer
from hf_memo.patches.apply import causal_lm_of
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.runtime.buckets import bucket_length

LAYERS = 6
STATES = ("parameter", "buffer", "gradient", "optimizer")


def _model(lora: bool) -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1000,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    return get_peft_model(model, LoraConfig(r=4, task_type="CAUSAL_LM")) if lora else model


def _gradients(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _need(model: torch.nn.Module, seq_len: int, policy: MemoryPolicy) -> int:
    """What a step of ``policy`` needs under the runtime's accounting on the CPU (nothing in use before the step:
    every gradient to come plus the step's bytes beyond the model states), from a direct whole-model profile."""
    target = causal_lm_of(model)
    profiler = StepProfiler(target.config, twin_preparer(model, policy), torch.float32, optimizer="none", kernels="cpu")
    device = peak(profiler.trace(bucket_length(seq_len)), "device")
    return _gradients(model) + device.total - sum(device.by_category[name] for name in STATES)


@pytest.mark.parametrize("lora,seq_len", [(False, 1024), (True, 1900)])
def test_the_policy_the_runtime_picks_under_a_device_limit_fits_its_direct_profile(lora, seq_len):
    probe = _model(lora)
    hf_memo.apply(probe, recompute="memo", offload_fraction=0.0)
    smallest = MemoryPolicy((LayerPolicy(False, True),) * (LAYERS - 2) + (LayerPolicy(False, False),) * 2)
    everything = MemoryPolicy((LayerPolicy(True, False, 1.0),) * LAYERS)
    low, high = _need(probe, seq_len, smallest), _need(probe, seq_len, everything)
    limit = (low + high) // 2  # room for some layers on the device, not all
    chosen = {}
    for sized in (True, False):
        model = _model(lora)
        hf_memo.apply(model, recompute="memo", device_memory_limit=limit, host_bandwidth=1e9, layer_time=1e-3)
        runtime = hf_memo.memo_runtime(model)
        if not sized:
            runtime.sizer = None  # the solver's own accounting, as before policies were sized
        ids = torch.randint(0, 1000, (1, seq_len))
        model(input_ids=ids, labels=ids).loss.backward()
        chosen[sized] = runtime.plan
    assert _need(probe, seq_len, chosen[True]) <= limit, (seq_len, chosen[True].summary())
    # the check can fail: the solver alone picks a policy whose working set does not fit
    assert _need(probe, seq_len, chosen[False]) > limit, (seq_len, chosen[False].summary())
