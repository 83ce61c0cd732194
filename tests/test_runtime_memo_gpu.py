"""The memo runtime on CUDA (GPU only): pinned host buffers pin their pages and nothing more, calibration's
chunked forward measured with CUDA events and the device memory counter, the "auto" device limit."""

import gc

import pytest
import torch

import hf_memo
from hf_memo.config import MemoConfig
from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.patches.layer_split import split_layer
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.calibration import time_layer_forward
from hf_memo.runtime.memo import MemoRuntime
from hf_memo.runtime.offload import PAGE, CopyEngine, HostPool
from tests.conftest import build_model, make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA runtime needs a GPU")


def test_cuda_pool_pins_exactly_its_pages_outside_pytorchs_pinned_allocator():
    device = torch.device("cuda")
    cached = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    pool, engine = HostPool(device), CopyEngine(device)
    nbytes = 3 * 2**20 + 5  # PyTorch's pinned allocator would pin 4 MiB
    buffer = pool.acquire(nbytes)
    assert buffer.is_pinned() and pool.reserved_bytes == -(-nbytes // PAGE) * PAGE
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == cached
    src = torch.randint(0, 256, (nbytes,), device=device, dtype=torch.uint8)
    engine.wait(engine.to_host(buffer, src))
    back = torch.empty_like(src)
    engine.wait(engine.to_device(back, buffer))
    torch.cuda.synchronize(device)
    assert torch.equal(back, src)
    pool.release(buffer)
    pool.end_step()  # acquired in this step: kept for the next one
    assert pool.reserved_bytes == -(-nbytes // PAGE) * PAGE
    pool.end_step()  # unused for a whole step: unpinned
    del buffer
    gc.collect()
    assert pool.reserved_bytes == 0


def test_cuda_timing_measures_the_chunked_forward_and_its_memory():
    model = build_model("llama", dtype=torch.bfloat16, num_hidden_layers=1, intermediate_size=1024).cuda()
    x = torch.randn(1, 4096, 32, dtype=torch.bfloat16, device="cuda")
    split = split_layer(
        model.model.layers[0], x, position_embeddings=model.model.rotary_emb(x, torch.arange(4096, device="cuda")[None])
    )
    chunked = time_layer_forward(split, x, chunk_bounds(4096, 8))
    whole = time_layer_forward(split, x, chunk_bounds(4096, 1))
    assert chunked.seconds > 0 and 0 < chunked.workspace_bytes < whole.workspace_bytes
    intermediate = 4096 * 1024 * 2  # one full-length (S, I) bf16 MLP intermediate
    assert whole.workspace_bytes - chunked.workspace_bytes > intermediate


def test_calibration_leaves_the_users_peak_memory_counter_alone():
    model = build_model("llama", dtype=torch.bfloat16, num_hidden_layers=1).cuda()
    x = torch.randn(1, 1024, 32, dtype=torch.bfloat16, device="cuda")
    split = split_layer(
        model.model.layers[0], x, position_embeddings=model.model.rotary_emb(x, torch.arange(1024, device="cuda")[None])
    )
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # a peak the user's step reached
    del big
    before = torch.cuda.max_memory_allocated()
    assert time_layer_forward(split, x, chunk_bounds(1024, 4)).workspace_bytes > 0
    assert torch.cuda.max_memory_allocated() == before


def test_on_cuda_auto_limits_the_device_to_what_is_free_and_a_tight_limit_keeps_inputs_only():
    device = torch.device("cuda")
    model = build_model("llama", dtype=torch.bfloat16, num_hidden_layers=2).cuda()
    x = torch.randn(1, 2048, 32, dtype=torch.bfloat16, device=device)
    split = split_layer(
        model.model.layers[0], x, position_embeddings=model.model.rotary_emb(x, torch.arange(2048, device=device)[None])
    )
    bounds = chunk_bounds(2048, 8)
    runtime = MemoRuntime(MemoConfig(recompute="memo", host_bandwidth=1e15, layer_time=1.0), num_layers=6)
    free, _ = torch.cuda.mem_get_info(device)
    assert runtime._device_limit(device) == free + torch.cuda.memory_reserved(device)
    assert runtime.alpha_chunks(split, x, bounds, LocalAttention, 0) == 8  # a small layer fits anywhere
    assert runtime.plan.bound == "all" and runtime.plan.predicted_step_seconds is not None  # the policy solver's
    workspace = time_layer_forward(split, x, bounds).workspace_bytes
    layer_input = x.numel() * x.element_size()
    # Two device layers and two copy buffers of one layer input each, half an input to spare: less than the
    # attention output a layer would keep beside it, so every layer keeps its input only.
    tight = torch.cuda.memory_allocated(device) + int(2.2 * workspace) + int(4.5 * layer_input)
    limited = MemoRuntime(MemoConfig(recompute="memo", host_bandwidth=1e15, device_memory_limit=f"{tight}B"), 6)
    limited.alpha_chunks(split, x, bounds, LocalAttention, 0)
    assert not any(layer.keep_attention for layer in limited.plan.layers)
    assert sum(layer.on_host for layer in limited.plan.layers) == 4 and limited.plan.bound == "device memory"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_only_layers_replay_cuda_attention_dropout(dtype):
    """The CUDA kernels draw attention dropout from the generator's Philox seed and offset, which the executor
    restores before recomputing attention: a policy of input-only layers trains exactly like one keeping the
    attention output, under the same seed (fp32: efficient kernel; bf16: flash)."""
    grads = []
    for keep_attention in (True, False):
        model = build_model("llama", dtype=dtype, num_hidden_layers=3, attention_dropout=0.2).cuda()
        hf_memo.apply(model, recompute="memo", mlp_chunks=2, lm_head_chunks=2)
        policy = LayerPolicy(keep_attention=keep_attention, on_host=True, alpha=0.5)
        hf_memo.memo_runtime(model).assume_policy(MemoryPolicy((policy,) * 3))
        ids, labels = (t.cuda() for t in make_batch(2, 256))
        torch.manual_seed(3)
        model(input_ids=ids, labels=labels).loss.backward()
        grads.append([p.grad.float() for p in model.parameters()])
    worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(*grads))
    print(f"input-only vs input+attention under CUDA attention dropout ({dtype}): worst relative {worst:.2e}")
    assert worst <= (1e-5 if dtype == torch.float32 else 2e-2)
