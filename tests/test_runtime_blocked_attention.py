"""Blocked causal attention against the attention core on the whole sequence: blocks of queries that do not divide
the sequence, their rows reassembled, their dK/dV and dsinks summed; and the per-KV-head backward of the kernels that
expand dK/dV, through a flash-attn stand-in on the CPU and in a fake profile for a CUDA target."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.profiler.allocations import AllocationRecorder
from hf_memo.profiler.kernel_workspace import KernelTarget, workspace_hook
from hf_memo.runtime import attention_core, blocked_attention, flash_attn_package
from hf_memo.runtime.attention_core import attention_backward, attention_forward
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.blocked_attention import (
    KeyGradSums,
    QueryBlockAttention,
    block_backward,
    block_forward,
    blockable,
)
from hf_memo.runtime.explicit_attention import explicit_backward, explicit_forward

SEQ = 29


def _inputs(batch, heads, kv_heads, dtype=torch.float64, seed=0, bshd=False):
    """q (in (B, S, h, D) memory if ``bshd``), k, v and an upstream gradient, ``SEQ`` tokens of head size 8."""
    gen = torch.Generator().manual_seed(seed)
    if bshd:
        q = torch.randn(batch, SEQ, heads, 8, dtype=dtype, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(batch, heads, SEQ, 8, dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, kv_heads, SEQ, 8, dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(batch, heads, SEQ, 8, dtype=dtype, generator=gen)


def _blocked(q, k, v, upstream, traits, size):
    """Blocks of ``size`` queries: out and lse rows concatenated, dq concatenated, dk, dv and dsinks summed."""
    outs, lses, dqs = [], [], []
    key_sums = KeyGradSums(k, v)
    dsinks = None if traits.sinks is None else torch.zeros_like(traits.sinks)
    for start in range(0, SEQ, size):
        rows, prefix = slice(start, start + size), slice(0, start + size)
        tensors = (q[:, :, rows], k[:, :, prefix], v[:, :, prefix])
        out, lse = block_forward(*tensors, start, traits)
        dq, block_dsinks = block_backward(upstream[:, :, rows], *tensors, out, lse, start, traits, key_sums)
        outs.append(out)
        lses.append(lse)
        dqs.append(dq)
        if dsinks is not None:
            dsinks += block_dsinks
    dk, dv = (t.to(k.dtype) for t in key_sums.pop(0, SEQ))
    return torch.cat(outs, 2), torch.cat(lses, 2), (torch.cat(dqs, 2), dk, dv, dsinks)


def _whole(q, k, v, upstream, traits):
    out, stats = attention_forward(q, k, v, traits)
    return out, stats.lse, attention_backward(upstream, q, k, v, out, stats, traits)


def _assert_close(got, want, tol):
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def _sinks(heads):
    return torch.randn(heads, dtype=torch.float64, generator=torch.Generator().manual_seed(9))


CASES = {
    "plain": (1, 4, 4, {}),
    "gqa": (1, 4, 2, {}),
    "mqa": (1, 4, 1, {}),
    "batch": (2, 4, 2, {}),
    "softcap": (1, 4, 2, {"softcap": 1.5}),
    "sinks": (1, 4, 2, {"sinks": _sinks(4)}),
    "softcap_sinks": (2, 4, 1, {"softcap": 1.5, "sinks": _sinks(4)}),
    "window_hiding_nothing": (1, 4, 2, {"window": SEQ}),
}


@pytest.mark.parametrize("size", [7, 1, SEQ])
@pytest.mark.parametrize("case", list(CASES))
def test_blocks_equal_the_whole_sequence_in_float64(case, size):
    batch, heads, kv_heads, extra = CASES[case]
    q, k, v, upstream = _inputs(batch, heads, kv_heads, bshd=case == "plain")
    traits = AttentionTraits(0.4, **extra)
    assert blockable(q.shape[2], traits)
    out, lse, grads = _blocked(q, k, v, upstream, traits, size)
    want_out, want_lse, want_grads = _whole(q, k, v, upstream, traits)
    _assert_close((out, lse), (want_out, want_lse), 1e-12)
    _assert_close(grads, want_grads, 1e-12)


def test_a_block_of_queries_in_bshd_memory_gets_its_output_in_bshd_memory():
    q, k, v, _ = _inputs(1, 4, 2, bshd=True)
    out, lse = block_forward(q[:, :, 7:14], k[:, :, :14], v[:, :, :14], 7, AttentionTraits(0.4))
    assert out.transpose(1, 2).is_contiguous() and lse.shape == (1, 4, 7)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_lower_precision_blocks_stay_close_to_the_whole_sequence(dtype, tol):
    q, k, v, upstream = _inputs(1, 4, 2, dtype, bshd=True)
    traits = AttentionTraits(0.4, sinks=_sinks(4).to(dtype))
    out, lse, grads = _blocked(q, k, v, upstream, traits, 7)
    want_out, want_lse, want_grads = _whole(q, k, v, upstream, traits)
    assert lse.dtype == torch.float32
    _assert_close((out, lse, *grads), (want_out, want_lse, *want_grads), tol)


def test_under_autocast_blocks_run_in_its_dtype_and_give_gradients_in_the_inputs():
    q, k, v, upstream = _inputs(1, 4, 2, torch.float32)
    traits = AttentionTraits(0.4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse, grads = _blocked(q, k, v, upstream, traits, 7)
        want_out, want_lse, want_grads = _whole(q, k, v, upstream, traits)
    assert out.dtype == torch.bfloat16 and [g.dtype for g in grads[:3]] == [torch.float32] * 3
    _assert_close((out, lse, *grads), (want_out, want_lse, *want_grads), 3e-2)


def test_dropout_and_a_window_that_hides_keys_are_not_blockable():
    q = torch.empty(1, 4, SEQ, 8)
    assert not blockable(q.shape[2], AttentionTraits(0.4, dropout_p=0.1))
    assert not blockable(q.shape[2], AttentionTraits(0.4, window=SEQ - 1))
    k = torch.empty(1, 4, SEQ, 8)
    with pytest.raises(ValueError, match="sliding window"):
        block_forward(q[:, :, 20:], k, k, 20, AttentionTraits(0.4, window=5))


class _FlashAttnOnCpu:
    """flash-attn's two private calls on ``(B, S, h, D)`` tensors, computed by the explicit kernel (which takes
    ``causal=False`` and recomputes the backward from the ``lse`` and ``out`` it is given); records the query and KV
    head counts of every backward."""

    def __init__(self):
        self.backward_heads = []

    @staticmethod
    def _traits(call):
        return AttentionTraits(call["softmax_scale"], softcap=call["softcap"] or None)

    def _flash_attn_forward(self, **call):
        q, k, v = (call[name].transpose(1, 2) for name in "qkv")
        out, lse = explicit_forward(q, k, v, self._traits(call), causal=call["causal"])
        return out.transpose(1, 2), lse, None, None

    def _flash_attn_backward(self, **call):
        self.backward_heads.append((call["q"].shape[2], call["k"].shape[2]))
        tensors = (call[name].transpose(1, 2) for name in ("dout", "q", "k", "v", "out"))
        grads = explicit_backward(*tensors, call["softmax_lse"], self._traits(call), causal=call["causal"])
        for target, grad in zip((call["dq"], call["dk"], call["dv"]), grads):
            target.copy_(grad.transpose(1, 2))


def test_on_flash_attn_the_backward_runs_once_per_kv_head_and_stays_exact(monkeypatch):
    q, k, v, upstream = _inputs(2, 4, 2, bshd=True)
    traits = AttentionTraits(0.4, softcap=1.5, sinks=_sinks(4))
    want_out, want_lse, want_grads = _whole(q, k, v, upstream, traits)
    stand_in = _FlashAttnOnCpu()
    monkeypatch.setattr(flash_attn_package, "flash_attn_interface", lambda: stand_in)
    for module in (attention_core, blocked_attention):
        monkeypatch.setattr(module, "backend_for", lambda q, traits, causal=True, value_head_dim=None: "flash-attn")
    out, lse, grads = _blocked(q, k, v, upstream, traits, 7)
    _assert_close((out, lse), (want_out, want_lse), 1e-12)
    _assert_close(grads, want_grads, 1e-12)
    blocks = -(-SEQ // 7)
    assert stand_in.backward_heads == [(2, 1)] * (2 * (2 * blocks - 1))  # 2 KV heads x (diagonal + prefix)


@pytest.mark.parametrize("blocks", [3, 5])
def test_on_flash_attn_the_query_block_core_expands_one_blocks_keys_per_call_and_stays_exact(monkeypatch, blocks):
    """After a sequence-parallel exchange a rank attends all keys of its heads: each block's prefix goes to the
    kernel in pieces of the block's length, so the expanded dK/dV never hold more keys than one block."""
    q, k, v, upstream = _inputs(2, 4, 2, bshd=True)
    traits = AttentionTraits(0.4, softcap=1.5, sinks=_sinks(4))
    want_out, want_stats = attention_forward(q, k, v, traits)
    want = attention_backward(upstream, q, k, v, want_out, want_stats, traits)
    stand_in = _FlashAttnOnCpu()
    monkeypatch.setattr(flash_attn_package, "flash_attn_interface", lambda: stand_in)
    for module in (attention_core, blocked_attention):
        monkeypatch.setattr(module, "backend_for", lambda q, traits, causal=True, value_head_dim=None: "flash-attn")
    keys = []
    backward = stand_in._flash_attn_backward
    monkeypatch.setattr(
        stand_in, "_flash_attn_backward", lambda **call: (keys.append(call["k"].shape[1]), backward(**call))
    )
    core = QueryBlockAttention(blocks)
    out, stats = core.forward(q, k, v, traits)
    _assert_close(core.backward(upstream, q, k, v, out, stats, traits), want, 1e-12)
    longest = -(-SEQ // blocks)
    assert max(keys) == longest < SEQ // 2
    pieces = sum(1 + -(-start // (stop - start)) * (start > 0) for start, stop in chunk_bounds(SEQ, blocks))
    assert len(keys) == 2 * pieces  # each KV head: every block's own keys and its prefix's pieces


@pytest.mark.parametrize(
    "target", [KernelTarget(), KernelTarget(flash_attn=False), KernelTarget(kernel="cuda-efficient")]
)
def test_a_fake_profile_for_a_cuda_target_records_one_groups_expanded_dk_dv(target):
    """h = 8 query heads on h_kv = 2: each backward call expands dK/dV to its group's 4 heads, not to 8 (flash-attn,
    PyTorch's flash kernel, and the memory-efficient kernel's dK/dV of K/V expanded for it)."""
    start, rows, heads, kv_heads, dim = 48, 16, 8, 2, 64
    with FakeTensorMode():
        q, out, grad_out = (torch.empty(1, rows, heads, dim, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        k, v = (torch.empty(1, start + rows, kv_heads, dim, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        lse = torch.empty(1, heads, rows)
        with AllocationRecorder(lambda: "layer", lambda: "backward", workspace_hook(target)) as recorder:
            dq, _ = block_backward(grad_out, q, k, v, out, lse, start, AttentionTraits(dim**-0.5), KeyGradSums(k, v))
    assert dq.shape == q.shape
    expanded = sorted(e.size for e in recorder.trace().events if e.source and e.source.endswith("dk_expanded"))
    group = heads // kv_heads
    assert expanded == sorted([rows * group * dim * 2] * kv_heads + [start * group * dim * 2] * kv_heads)


@pytest.mark.parametrize("blocks", [1, 3, 8, 100])
@pytest.mark.parametrize("case", ["plain", "mqa", "batch", "softcap_sinks"])
def test_the_query_block_core_equals_the_local_core_on_the_whole_sequence(case, blocks):
    batch, heads, kv_heads, extra = CASES[case]
    q, k, v, upstream = _inputs(batch, heads, kv_heads, bshd=True)
    traits = AttentionTraits(0.4, **extra)
    core = QueryBlockAttention(blocks)
    out, stats = core.forward(q, k, v, traits)
    want_out, want_stats = attention_forward(q, k, v, traits)
    assert out.transpose(1, 2).is_contiguous()  # rows of (B, S, h, D) memory, as the executor keeps them
    _assert_close((out, stats.lse), (want_out, want_stats.lse), 1e-12)
    got = core.backward(upstream, q, k, v, out, stats, traits)
    _assert_close(got, attention_backward(upstream, q, k, v, want_out, want_stats, traits), 1e-12)


def test_the_query_block_core_runs_attention_whole_where_it_may_not_block():
    q, k, v, upstream = _inputs(1, 4, 2)
    traits = AttentionTraits(0.4, dropout_p=0.3)
    torch.manual_seed(5)
    out, stats = QueryBlockAttention(4).forward(q, k, v, traits)
    torch.manual_seed(5)
    want_out, want_stats = attention_forward(q, k, v, traits)  # the same mask: one call, as the local core
    assert torch.equal(out, want_out)
    got = QueryBlockAttention(4).backward(upstream, q, k, v, out, stats, traits)
    _assert_close(got, attention_backward(upstream, q, k, v, want_out, want_stats, traits), 0)


def test_key_grad_sums_in_pieces_equal_one_sum_and_refuse_keys_of_a_finished_piece():
    """Prefix gradients of several kernel calls (per KV head and whole), added to pieces that do not line up with the
    calls' keys: each piece holds exactly its positions of one running fp32 sum; a popped piece takes no more."""
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 2, SEQ, 8, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    bounds = chunk_bounds(SEQ, 4)
    pieces, whole = KeyGradSums(k, v, list(reversed(bounds))), KeyGradSums(k, v)
    calls = [(slice(0, 1), slice(3, 20)), (slice(1, 2), slice(0, SEQ)), (slice(None), slice(9, 11))]
    for heads, keys in calls:
        shape = (1, 2 if heads.start is None else 1, keys.stop - keys.start, 8)
        dk, dv = (torch.randn(shape, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        pieces.add(heads, keys, dk, dv)
        whole.add(heads, keys, dk, dv)
    want_k, want_v = whole.pop(0, SEQ)
    assert want_k.dtype == torch.float32
    for start, stop in bounds[::-1][:-1]:
        got_k, got_v = pieces.pop(start, stop)
        assert torch.equal(got_k, want_k[:, :, start:stop]) and torch.equal(got_v, want_v[:, :, start:stop])
    with pytest.raises(ValueError, match="reach past the pieces still summed"):
        pieces.add(slice(None), slice(0, SEQ), torch.zeros(1, 2, SEQ, 8), torch.zeros(1, 2, SEQ, 8))
