"""Ulysses head/sequence exchange: layout, round trip, GQA replication, autograd, and an attention core run
as an explicit forward/backward pair (as a layer executor calls it) against plain full-sequence attention."""

import pytest
import torch
import torch.nn.functional as F

from hf_memo.parallel.groups import sequence_parallel_groups
from hf_memo.parallel.ulysses import (
    gather_heads_scatter_sequence,
    replicate_kv_heads,
    replicated_kv_heads,
    scatter_heads_gather_sequence,
    scatter_heads_gather_sequence_differentiable,
    sum_replicated_kv_heads,
)
from tests.multiprocess import run_processes

BATCH, HEADS, SEQ, DIM = 2, 8, 12, 4


@pytest.mark.parametrize("kv_heads,sp", [(2, 4), (1, 4), (2, 8), (4, 4), (8, 2)])
def test_kv_replication_and_its_gradient(kv_heads, sp):
    x = torch.randn(BATCH, kv_heads, 5, DIM, dtype=torch.float64, requires_grad=True)
    replicated = replicate_kv_heads(x, sp)
    assert replicated.shape[1] == replicated_kv_heads(kv_heads, sp) == max(kv_heads, sp)
    copies = replicated.shape[1] // kv_heads
    for head in range(replicated.shape[1]):
        torch.testing.assert_close(replicated[:, head], x[:, head // copies])
    grad = torch.randn_like(replicated)
    replicated.backward(grad)
    torch.testing.assert_close(sum_replicated_kv_heads(grad, kv_heads), x.grad)


def _full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _seq_shard(x, rank, sp):
    step = x.shape[2] // sp
    return x[:, :, rank * step : (rank + 1) * step]


def _head_shard(x, rank, sp):
    step = x.shape[1] // sp
    return x[:, rank * step : (rank + 1) * step]


def _attention_core_pair(q, k, v, grad_out):
    """Forward and backward of causal attention as two explicit calls (the CPU flash-attention pair)."""
    groups = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k_full, v_full, 0.0, True)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k_full, v_full, out, logsumexp, 0.0, True
    )
    return out, dq, dk.unflatten(1, (k.shape[1], groups)).sum(2), dv.unflatten(1, (k.shape[1], groups)).sum(2)


def _exchange_worker(rank, world):
    results = {}
    for sp in (world, 2):
        groups = sequence_parallel_groups(sp)
        seed = 10 * sp + groups.dp_rank  # every replica has its own data: groups must not mix them
        full = _full((BATCH, HEADS, SEQ, DIM), seed)
        mine = _seq_shard(full, groups.sp_rank, sp)
        scattered = scatter_heads_gather_sequence(mine, groups.group)
        back = gather_heads_scatter_sequence(scattered, groups.group)
        weights = _full((BATCH, HEADS, SEQ, DIM), seed + 1)
        leaf = mine.clone().requires_grad_()
        exchanged = scatter_heads_gather_sequence_differentiable(leaf, groups.group)
        (exchanged * _head_shard(weights, groups.sp_rank, sp)).sum().backward()
        results[f"sp{sp}"] = {
            "layout_error": (scattered - _head_shard(full, groups.sp_rank, sp)).abs().max().item(),
            "round_trip_error": (back - mine).abs().max().item(),
            "differentiable_forward_error": (exchanged - scattered).abs().max().item(),
            "gradient_error": (leaf.grad - _seq_shard(weights, groups.sp_rank, sp)).abs().max().item(),
        }
        for kv_heads in (1, 2, 4, 8):
            if not (kv_heads % sp == 0 or sp % kv_heads == 0):
                continue
            q, k, v = (
                _full((BATCH, HEADS, SEQ, DIM), seed + 2),
                *(_full((BATCH, kv_heads, SEQ, DIM), seed + s) for s in (3, 4)),
            )
            grad_out = _full((BATCH, HEADS, SEQ, DIM), seed + 5)
            want_out, want_dq, want_dk, want_dv = _attention_core_pair(q, k, v, grad_out)
            # this rank's tokens in, exchange, core forward, exchange back; then the same for backward
            local = [_seq_shard(t, groups.sp_rank, sp) for t in (q, k, v)]
            lq = scatter_heads_gather_sequence(local[0], groups.group)
            lk, lv = (scatter_heads_gather_sequence(replicate_kv_heads(t, sp), groups.group) for t in local[1:])
            grad_heads = scatter_heads_gather_sequence(_seq_shard(grad_out, groups.sp_rank, sp), groups.group)
            out, dq, dk, dv = _attention_core_pair(lq, lk, lv, grad_heads)
            out = gather_heads_scatter_sequence(out, groups.group)
            dq = gather_heads_scatter_sequence(dq, groups.group)
            dk, dv = (
                sum_replicated_kv_heads(gather_heads_scatter_sequence(g, groups.group), kv_heads) for g in (dk, dv)
            )
            wants = (want_out, want_dq, want_dk, want_dv)
            results[f"sp{sp}-kv{kv_heads}"] = {
                name: (got - _seq_shard(want, groups.sp_rank, sp)).abs().max().item()
                for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), wants)
            }
            plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            results[f"sp{sp}-kv{kv_heads}"]["core_vs_sdpa"] = (want_out - plain).abs().max().item()
    return results


def test_exchange_and_attention_core_on_four_ranks():
    """Four ranks: one group of 4, and two replicas of 2 with different data. KV heads 1, 2, 4, 8 for 8 query
    heads: replicated (sp > kv), one per rank, and several per rank."""
    per_rank = run_processes(_exchange_worker, 4)
    checked = 0
    for rank, results in enumerate(per_rank):
        for case, errors in results.items():
            for name, error in errors.items():
                assert error < 1e-12, f"rank {rank}, {case}: {name} differs by {error}"
                checked += 1
    assert checked == 4 * (2 * 4 + 4 * 5 + 4 * 5)
