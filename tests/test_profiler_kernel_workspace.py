import pytest
import torch
from transformers import LlamaConfig

import hf_memo
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.kernel_workspace import (
    CPU,
    CUDA,
    AttentionCall,
    KernelTarget,
    backward_workspace,
    efficient_backward_workspace_bytes,
    flash_forward_splits,
    forward_workspace,
    kernel_target,
    workspace_hook,
)
from hf_memo.profiler.step import trace_training_step
from hf_memo.runtime.attention_core import device_target

BF16, F32 = torch.bfloat16, torch.float32
# Llama-3-8B's attention (32 query heads, 8 KV heads, head size 128) at 32K tokens
LLAMA = AttentionCall(1, 32, 8, 32768, 32768, 128, 128, BF16)
# Attention wide against a narrow residual stream, so that a step's peak is its attention backward
CONFIG = LlamaConfig(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=8,
    vocab_size=32,
    max_position_embeddings=1 << 12,
)
SEQ = 256
CALL = AttentionCall(1, 16, 4, SEQ, SEQ, 8, 8, BF16)


def _sizes(workspace):
    return {buffer.name: buffer.nbytes for buffer in workspace.buffers}


def test_flash_backward_of_grouped_query_attention_by_hand():
    s, h, d = 32768, 32, 128
    expected = {
        "softmax_d": h * s * 4,
        "dq_accum": s * h * d * 4,
        "dk_expanded": s * h * d * 2,
        "dv_expanded": s * h * d * 2,
    }
    for kernel in ("flash-attn", "cuda-flash"):
        workspace = backward_workspace(kernel, LLAMA)
        assert _sizes(workspace) == expected
        assert workspace.nbytes == workspace.peak_bytes == sum(expected.values())


def test_flash_backward_of_multi_head_attention_rounds_queries_to_128_and_heads_to_32_or_64():
    call = AttentionCall(2, 4, 4, 1000, 1000, 72, 72, BF16)
    assert _sizes(backward_workspace("flash-attn", call)) == {
        "softmax_d": 2 * 4 * 1024 * 4,
        "dq_accum": 2 * 1024 * 4 * 96 * 4,
    }
    wide = AttentionCall(1, 4, 4, 128, 128, 160, 160, BF16)
    assert _sizes(backward_workspace("flash-attn", wide))["dq_accum"] == 128 * 4 * 192 * 4


def test_pytorch_flash_copies_gradients_and_outputs_that_are_not_laid_out_by_token():
    call = AttentionCall(1, 4, 2, 256, 256, 64, 64, BF16, grad_out_bshd=False)
    assert _sizes(backward_workspace("cuda-flash", call))["contiguous_grad_out"] == 256 * 4 * 64 * 2
    assert "contiguous_grad_out" not in _sizes(backward_workspace("flash-attn", call))
    q = torch.empty(1, 256, 4, 64).transpose(1, 2)  # (B, h, S, D) view of token-major memory
    kv = torch.empty(1, 2, 256, 64)
    assert AttentionCall.of(q, kv, kv, grad_out=q, out=q.contiguous()) == AttentionCall(
        1, 4, 2, 256, 256, 64, 64, F32, out_bshd=False
    )


def test_flash_forward_splits_keys_only_for_calls_too_small_to_fill_the_gpu():
    assert flash_forward_splits(LLAMA) == 1 and forward_workspace("flash-attn", LLAMA).events == ()
    # 16 heads x 8 blocks of 64 queries = 128 < 0.8 x 264 blocks; two splits of 256 keys fill 97% of a wave
    small = AttentionCall(1, 16, 4, 512, 512, 8, 8, BF16)
    assert flash_forward_splits(small) == 2
    assert _sizes(forward_workspace("flash-attn", small)) == {
        "softmax_lse_accum": 2 * 16 * 512 * 4,
        "out_accum": 2 * 16 * 512 * 32 * 4,
    }
    assert flash_forward_splits(AttentionCall(1, 16, 4, 512, 512, 8, 8, BF16, dropout_p=0.1)) == 1


def test_efficient_backward_by_hand():
    call = AttentionCall(1, 8, 8, 1000, 1000, 128, 128, BF16)  # kernel 128x128 k128: dK/dV in registers
    tiles = -(-1000 // 128) * (4 + 128 * 128)
    assert efficient_backward_workspace_bytes(call) == 8 * tiles * 4
    assert _sizes(backward_workspace("cuda-efficient", call)) == {"delta": 8 * 1000 * 4, "workspace": 8 * tiles * 4}
    wide = AttentionCall(1, 2, 2, 256, 256, 256, 256, BF16)  # kernel 128x64 k65536: dK/dV accumulated, 4 key splits
    gq = 2 * 4 * (4 + 128 * 64)
    gkv = 2 * 4 * 64 * 256
    assert efficient_backward_workspace_bytes(wide) == 2 * (gq + gkv) * 4


def test_efficient_backward_in_fp32_builds_delta_from_a_product_freed_before_the_kernel():
    call = AttentionCall(1, 4, 4, 512, 512, 64, 64, F32)
    workspace = backward_workspace("cuda-efficient", call)
    product, rows, delta = 512 * 4 * 64 * 4, 512 * 4 * 4, 4 * 512 * 4
    scratch = efficient_backward_workspace_bytes(call)
    assert scratch == 4 * 8 * (4 + 64 * 64) * 4  # kernel 64x64 k64
    assert workspace.nbytes == product + rows + delta + scratch
    assert workspace.peak_bytes == max(product + rows + delta, delta + scratch)


def test_efficient_backward_expands_grouped_keys_and_values_as_the_attention_core_does():
    sizes = _sizes(backward_workspace("cuda-efficient", CALL))
    expanded = SEQ * 16 * 8 * 2
    assert [sizes[name] for name in ("k_expanded", "v_expanded", "dk_expanded", "dv_expanded")] == [expanded] * 4
    assert _sizes(forward_workspace("cuda-efficient", CALL)) == {"k_expanded": expanded, "v_expanded": expanded}


def test_the_target_picks_kernels_by_the_runtime_rule_on_a_hopper_gpu():
    assert CUDA.kernel_for(LLAMA) == "flash-attn"
    assert KernelTarget(flash_attn=False).kernel_for(LLAMA) == "cuda-flash"
    assert CUDA.kernel_for(AttentionCall(1, 4, 4, 64, 64, 128, 128, F32)) == "cuda-efficient"
    assert CUDA.kernel_for(AttentionCall(1, 4, 4, 64, 64, 4, 4, BF16)) == "cuda-efficient"
    assert CUDA.kernel_for(LLAMA, masked=True) == "cuda-efficient"
    assert CPU.kernel_for(LLAMA) == "cpu"
    assert kernel_target("cuda-flash").kernel_for(LLAMA) == "cuda-flash"
    assert kernel_target("cuda") is CUDA and kernel_target("cpu") is CPU
    assert workspace_hook("cpu") is None and device_target(torch.device("cpu")) is CPU
    with pytest.raises(ValueError, match="kernels must be"):
        kernel_target("gpu")


def _trace(mode, kernels, seq_len=SEQ, config=CONFIG):
    model, session = fake_causal_lm(config, BF16)
    with session:
        if mode == "memo":
            hf_memo.apply(model, recompute="memo")
        return trace_training_step(model, 1, seq_len, "none", kernels=kernels)


def _renumbered(events):
    ids = {}
    return [(e.op, ids.setdefault(e.tensor_id, len(ids)), e.size, e.phase, e.category, e.location) for e in events]


def _workspace_ids(trace, marker=" workspace "):
    return {e.tensor_id for e in trace.events if e.op == "malloc" and e.source and marker in e.source}


def test_memo_s_cuda_profile_is_its_cpu_profile_plus_the_kernels_workspace_where_the_calls_are_the_same():
    """Without grouped-query attention memo's backward makes the same kernel calls for both targets (on a CUDA
    target a GQA backward runs once per KV head, see tests/test_runtime_blocked_attention.py)."""
    config = LlamaConfig(**{**CONFIG.to_dict(), "num_key_value_heads": CONFIG.num_attention_heads})
    cpu, cuda = _trace("memo", "cpu", config=config), _trace("memo", "cuda", config=config)
    workspace_ids = _workspace_ids(cuda)
    assert workspace_ids
    assert _renumbered(cpu.events) == _renumbered([e for e in cuda.events if e.tensor_id not in workspace_ids])


@pytest.mark.parametrize("mode", ["sdpa"])
def test_the_cuda_profile_is_the_cpu_profile_plus_each_attention_backwards_workspace(mode):
    cpu, cuda = _trace(mode, "cpu"), _trace(mode, "cuda")
    workspace_ids = _workspace_ids(cuda)
    assert _renumbered(cpu.events) == _renumbered([e for e in cuda.events if e.tensor_id not in workspace_ids])

    expected = backward_workspace("flash-attn", CALL)
    backward = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    calls = [
        i for i, e in enumerate(cuda.events) if e.op == "malloc" and e.source and e.source.endswith(f"> {backward}")
    ]
    assert len(calls) == 6  # dq, dk, dv of each layer
    for last_output in calls[2::3]:
        added = cuda.events[last_output + 1 : last_output + 1 + 2 * len(expected.buffers)]
        assert [(e.op, e.size, e.category) for e in added] == [
            *(("malloc", b.nbytes, "temporary") for b in expected.buffers),
            *(("free", b.nbytes, "temporary") for b in reversed(expected.buffers)),
        ]
        assert all(e.source.startswith(f"{backward} > flash-attn workspace ") for e in added if e.op == "malloc")

    top = peak(cuda)  # the last layer's attention backward, its workspace all allocated
    assert cuda.events[top.index].source == f"{backward} > flash-attn workspace dv_expanded"
    before = cuda.events[: top.index + 1 - len(expected.buffers)]
    live = sum(e.size if e.op == "malloc" else -e.size for e in before if e.location == "device")
    assert top.total == live + expected.nbytes
    assert top.total > peak(cpu).total


def test_the_flash_forward_workspace_of_short_calls_is_traced_and_freed_within_the_call():
    config = LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 1})
    trace = _trace("sdpa", "cuda", 512, config)
    forward = "aten._scaled_dot_product_flash_attention_for_cpu.default > flash-attn workspace "
    added = [(e.op, e.size, e.phase) for e in trace.events if e.source and e.source.startswith(forward)]
    assert added == [
        ("malloc", 2 * 16 * 512 * 4, "layer 0 forward"),
        ("malloc", 2 * 16 * 512 * 32 * 4, "layer 0 forward"),
    ]
    workspace_ids = _workspace_ids(trace, forward)
    assert all(e.category == "temporary" for e in trace.events if e.tensor_id in workspace_ids)
    assert sum(e.op == "free" for e in trace.events if e.tensor_id in workspace_ids) == 2


def test_step_profiler_answers_for_the_cuda_kernels_unless_told_otherwise():
    def prepare(model, session):
        return model

    config = LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 1})
    default, cpu = (
        StepProfiler(config, prepare, BF16, optimizer="none", **kw).trace(SEQ) for kw in ({}, {"kernels": "cpu"})
    )
    assert peak(default).total - peak(cpu).total > 0
    assert any(e.source and "flash-attn workspace" in e.source for e in default.events)
    assert not any(e.source and "workspace" in e.source for e in cpu.events)
