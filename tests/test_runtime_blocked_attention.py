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


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """ATen's ``is_non_overlapping_and_dense``: the elements fill ``numel`` consecutive places, in some order of the
    dims (dims of size 1 take any stride)."""
    expected = 1
    for dim in sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=t.stride):
        if t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def _fast_path_refusal(totals: list[torch.Tensor], parts: list[torch.Tensor]) -> str | None:
    """Why ATen's CUDA ``_foreach_add_(totals, parts)`` would take its slow path (one kernel per pair), or ``None``
    (``aten/src/ATen/native/ForeachUtils.h``: ``can_use_fast_route``): every tensor strided, dense and of one device
    and dtype; each pair of the same sizes and strides (strides of dims of size 1 aside)."""
    first = totals[0]
    for t in totals + parts:
        if t.layout != torch.strided or t.device != first.device or t.dtype != first.dtype:
            return f"{t.dtype} {t.layout} on {t.device}, not {first.dtype} strided on {first.device}"
        if not _non_overlapping_and_dense(t):
            return f"not dense: sizes {tuple(t.shape)} strides {t.stride()}"
    for total, part in zip(totals, parts):
        strides = [(a, b) for a, b, size in zip(total.stride(), part.stride(), total.shape) if size != 1]
        if total.shape != part.shape or any(a != b for a, b in strides):
            return f"pair differs: {tuple(total.shape)} {total.stride()} and {tuple(part.shape)} {part.stride()}"
    return None


def test_the_fast_path_check_refuses_what_aten_refuses():
    sums = torch.zeros(2, 6, 3, 8)
    grad = torch.zeros(2, 6, 3, 8, dtype=torch.bfloat16)
    assert _fast_path_refusal([sums], [grad.float()]) is None
    assert _fast_path_refusal([sums[:, 1:4]], [grad.float()[:, 1:4].contiguous()]).startswith("not dense")
    assert "bfloat16" in _fast_path_refusal([sums], [grad])
    assert _fast_path_refusal([sums], [grad.float().transpose(0, 1).contiguous().transpose(0, 1)]).startswith("pair")


@pytest.fixture
def foreach_adds(monkeypatch):
    """The ``(totals, parts)`` lists of every ``torch._foreach_add_`` call while the test runs."""
    calls, add = [], torch._foreach_add_
    monkeypatch.setattr(
        torch, "_foreach_add_", lambda totals, parts: (calls.append((totals, parts)), add(totals, parts))
    )
    return calls


def _use_flash_attn_stand_in(monkeypatch) -> None:
    """Blocked attention runs on flash-attn, whose backward expands dK/dV (computed by :class:`_FlashAttnOnCpu`)."""
    monkeypatch.setattr(flash_attn_package, "flash_attn_interface", lambda: _FlashAttnOnCpu())
    for module in (attention_core, blocked_attention):
        monkeypatch.setattr(module, "backend_for", lambda q, traits, causal=True, value_head_dim=None: "flash-attn")


@pytest.mark.parametrize("kernel", ["native", "flash-attn"])
@pytest.mark.parametrize("batch,kv_heads", [(1, 2), (2, 2), (1, 4), (2, 4)])
def test_each_kernel_calls_key_gradients_go_to_the_sums_in_one_foreach_add_on_its_fast_path(
    monkeypatch, foreach_adds, kernel, batch, kv_heads
):
    """bf16 on GQA (expanded per KV head on flash-attn) and MHA, in pieces as the executor runs them (last chunk
    first, each chunk's sums popped when it is done): every add is one foreach call whose lists meet the fast path's
    conditions, and the sums are exactly the fp32 sums of the kernels' dk, dv (as adding each piece alone gave
    them), close to the whole sequence's attention."""
    if kernel == "flash-attn":
        _use_flash_attn_stand_in(monkeypatch)
    q, k, v, upstream = (t.to(torch.bfloat16) for t in _inputs(batch, 4, kv_heads, bshd=True))
    traits = AttentionTraits(0.4)
    want = [torch.zeros(k.shape, dtype=torch.float32) for _ in range(2)]
    calls, add = [], KeyGradSums.add

    def add_and_sum(self, heads, keys, dk, dv):
        calls.append(heads)
        for total, grad in zip(want, (dk, dv)):
            total[:, heads, keys] += grad.float()
        add(self, heads, keys, dk, dv)

    monkeypatch.setattr(KeyGradSums, "add", add_and_sum)
    bounds = chunk_bounds(SEQ, 4)
    key_sums = KeyGradSums(k, v, bounds)
    got = [torch.full(k.shape, torch.nan, dtype=torch.float32) for _ in range(2)]
    for start, stop in reversed(bounds):
        rows, prefix = slice(start, stop), slice(0, stop)
        tensors = (q[:, :, rows], k[:, :, prefix], v[:, :, prefix])
        out, lse = block_forward(*tensors, start, traits)
        block_backward(upstream[:, :, rows], *tensors, out, lse, start, traits, key_sums)
        for total, sums in zip(got, key_sums.pop(start, stop)):
            total[:, :, rows] = sums
    assert len(foreach_adds) == len(calls) == (2 * len(bounds) - 1) * (kv_heads if calls[0].start is not None else 1)
    assert (calls[0].start is not None) == (kernel == "flash-attn" and kv_heads < 4)  # per KV head where expanded
    assert [_fast_path_refusal(*lists) for lists in foreach_adds] == [None] * len(foreach_adds)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _, _, (_, want_dk, want_dv, _) = _whole(*(t.double() for t in (q, k, v, upstream)), traits)
    _assert_close(got, (want_dk.float(), want_dv.float()), 3e-2)


@pytest.mark.parametrize("target", [KernelTarget(), KernelTarget(flash_attn=False)])
def test_a_fake_profile_for_a_cuda_target_adds_each_calls_key_gradients_on_the_fast_path(foreach_adds, target):
    """The flash kernels of a CUDA target, per KV head (h = 8 on h_kv = 2), batch 2: one fast-path add per call."""
    start, rows, kv_heads, dim = 48, 16, 2, 64
    with FakeTensorMode():
        q, out, grad_out = (torch.empty(2, rows, 8, dim, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        k, v = (torch.empty(2, start + rows, kv_heads, dim, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        key_sums = KeyGradSums(k, v, chunk_bounds(start + rows, 4))
        with AllocationRecorder(lambda: "layer", lambda: "backward", workspace_hook(target)):
            block_backward(grad_out, q, k, v, out, torch.empty(2, 8, rows), start, AttentionTraits(dim**-0.5), key_sums)
    assert len(foreach_adds) == 2 * kv_heads
    assert [_fast_path_refusal(*lists) for lists in foreach_adds] == [None] * len(foreach_adds)
