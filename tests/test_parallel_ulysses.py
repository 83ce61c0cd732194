"""Ulysses head/sequence exchange at any degree: layout, round trip, KV heads repeated after the exchange, autograd,
and an attention core run as an explicit forward/backward pair (as a layer executor calls it) against plain
full-sequence attention, for head counts the degree divides and for uneven splits (GQA groups straddling ranks)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sliding_window_causal_mask_function

from hf_memo.parallel.attention import ulysses_attention
from hf_memo.parallel.groups import sequence_parallel_groups
from hf_memo.parallel.heads import HeadSplit
from hf_memo.parallel.memo_attention import UlyssesAttention
from hf_memo.parallel.ulysses import (
    gather_heads_scatter_sequence,
    gather_heads_scatter_sequence_differentiable,
    repeat_kv_heads,
    scatter_heads_gather_sequence,
    scatter_heads_gather_sequence_differentiable,
    sum_repeated_kv_heads,
)
from hf_memo.runtime.attention_core import attention_backward, attention_forward
from hf_memo.runtime.attention_traits import AttentionTraits
from tests.multiprocess import run_processes

BATCH, HEADS, SEQ, DIM = 2, 8, 12, 4


@pytest.mark.parametrize("heads,kv_heads,sp", [(6, 2, 4), (10, 2, 3), (28, 4, 8), (8, 2, 4)])
def test_repeated_kv_heads_are_the_ones_each_query_head_uses_and_their_gradient_sums_the_copies(heads, kv_heads, sp):
    split = HeadSplit(heads, kv_heads, sp)
    for rank in range(sp):
        received = split.kv(rank)
        x = torch.randn(BATCH, len(received), 5, DIM, dtype=torch.float64, requires_grad=True)
        repeated = repeat_kv_heads(x, split, rank)
        assert repeated.shape[1] == split.attended_kv_heads(rank)
        if split.kv_repeats(rank) is not None:  # one KV head per query head: query head q uses KV head q // group
            for i, head in enumerate(split.query(rank)):
                torch.testing.assert_close(repeated[:, i], x[:, head // (heads // kv_heads) - received.start])
        grad = torch.randn_like(repeated)
        repeated.backward(grad)
        torch.testing.assert_close(sum_repeated_kv_heads(grad, split, rank), x.grad)


def _full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _seq_shard(x, rank, sp):
    step = x.shape[2] // sp
    return x[:, :, rank * step : (rank + 1) * step]


def _heads(x, heads: range):
    return x[:, heads.start : heads.stop]


def _attention_core_pair(q, k, v, grad_out):
    """Forward and backward of causal attention as two explicit calls (the CPU flash-attention pair)."""
    groups = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k_full, v_full, 0.0, True)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k_full, v_full, out, logsumexp, 0.0, True
    )
    return out, dq, dk.unflatten(1, (k.shape[1], groups)).sum(2), dv.unflatten(1, (k.shape[1], groups)).sum(2)


# (query heads, KV heads): degrees that divide them, and uneven splits where GQA groups straddle ranks
HEAD_SHAPES = [(8, 1), (8, 2), (8, 4), (8, 8), (6, 2), (5, 5), (10, 2)]
TRAIT_SHAPES = [(8, 2), (6, 2)]  # heads of the window/soft-cap/sinks checks


def _exchange_checks(groups, sp, heads, kv_heads, seed):
    """Layout, round trip and gradient of both exchanges (query heads a partition, KV heads overlapping ranges),
    then the exchange around an explicit attention core pair against the core on the whole sequence."""
    split, rank, group = HeadSplit(heads, kv_heads, sp), groups.sp_rank, groups.group
    errors = {}
    for name, ranges, count in (("q", split.queries, heads), ("kv", split.kvs, kv_heads)):
        full, weights = _full((BATCH, count, SEQ, DIM), seed), _full((BATCH, count, SEQ, DIM), seed + 1)
        mine = _seq_shard(full, rank, sp)
        scattered = scatter_heads_gather_sequence(mine, ranges, group)
        holders = torch.tensor([sum(h in r for r in ranges) for h in range(count)], dtype=full.dtype)[:, None, None]
        leaf = mine.clone().requires_grad_()
        exchanged = scatter_heads_gather_sequence_differentiable(leaf, ranges, group)
        (exchanged * _heads(weights, ranges[rank])).sum().backward()
        errors[f"{name}-layout"] = _max_error(scattered, _heads(full, ranges[rank]))
        errors[f"{name}-round-trip"] = _max_error(
            gather_heads_scatter_sequence(scattered, ranges, count, group), mine * holders
        )
        errors[f"{name}-differentiable"] = _max_error(exchanged, scattered)
        errors[f"{name}-gradient"] = _max_error(leaf.grad, _seq_shard(weights, rank, sp) * holders)
    # the attention output's layout (B, S, h_r, D) -> (B, S / sp, h, D), differentiable
    out_full = _full((BATCH, SEQ, heads, DIM), seed + 2)
    out_mine = out_full[:, :, split.query(rank).start : split.query(rank).stop].clone().requires_grad_()
    back = gather_heads_scatter_sequence_differentiable(out_mine, split.queries, heads, group, 2, 1)
    shard = slice(rank * SEQ // sp, (rank + 1) * SEQ // sp)
    (back * out_full[:, shard]).sum().backward()
    errors["out-layout"] = _max_error(back, out_full[:, shard])
    errors["out-gradient"] = _max_error(out_mine.grad, out_mine.detach())

    q, grad_out = _full((BATCH, heads, SEQ, DIM), seed + 3), _full((BATCH, heads, SEQ, DIM), seed + 4)
    k, v = (_full((BATCH, kv_heads, SEQ, DIM), seed + s) for s in (5, 6))
    wants = _attention_core_pair(q, k, v, grad_out)
    # this rank's tokens in, exchange, core forward, exchange back; then the same for backward
    local = [_seq_shard(t, rank, sp) for t in (q, k, v, grad_out)]
    lq, lgrad = (scatter_heads_gather_sequence(t, split.queries, group) for t in (local[0], local[3]))
    lk, lv = (repeat_kv_heads(scatter_heads_gather_sequence(t, split.kvs, group), split, rank) for t in local[1:3])
    out, dq, dk, dv = _attention_core_pair(lq, lk, lv, lgrad)
    out, dq = (gather_heads_scatter_sequence(t, split.queries, heads, group) for t in (out, dq))
    dk, dv = (
        gather_heads_scatter_sequence(sum_repeated_kv_heads(g, split, rank), split.kvs, kv_heads, group)
        for g in (dk, dv)
    )
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), wants):
        errors[name] = _max_error(got, _seq_shard(want, rank, sp))
    errors["core_vs_sdpa"] = _max_error(
        wants[0], F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
    return errors


def exchange_results(degrees) -> dict:
    """Every check of this file on this rank, for each sequence-parallel degree of ``degrees``."""
    results = {}
    for sp in degrees:
        groups = sequence_parallel_groups(sp)
        seed = 10 * sp + groups.dp_rank  # every replica has its own data: groups must not mix them
        for heads, kv_heads in HEAD_SHAPES:
            if heads >= sp:
                results[f"sp{sp}-h{heads}-kv{kv_heads}"] = _exchange_checks(groups, sp, heads, kv_heads, seed)
        for heads, kv_heads in TRAIT_SHAPES:
            results[f"sp{sp}-h{heads}-memo-traits"] = _memo_core_with_traits(groups, sp, heads, kv_heads, seed)
            results[f"sp{sp}-h{heads}-autograd-traits"] = _autograd_attention_with_traits(
                groups, sp, heads, kv_heads, seed
            )
    return results


def _exchange_worker(rank, world):
    return exchange_results((world, 2))


def _max_error(got, want):
    return (got - want).abs().max().item()


def _memo_core_with_traits(groups, sp, heads, kv_heads, seed):
    """The memo executor's Ulysses core with a window, soft-capped scores and sinks against the local core on the
    whole sequence: each rank's dsinks is its heads' share (zero elsewhere), the group's sum the whole gradient."""
    q, grad_out = _full((BATCH, heads, SEQ, DIM), seed + 6), _full((BATCH, heads, SEQ, DIM), seed + 7)
    k, v = (_full((BATCH, kv_heads, SEQ, DIM), seed + s) for s in (8, 9))
    traits = AttentionTraits(0.4, window=5, softcap=2.0, sinks=_full((heads,), seed + 10))
    want_out, want_stats = attention_forward(q, k, v, traits)
    wants = (want_out, *attention_backward(grad_out, q, k, v, want_out, want_stats, traits))
    core = UlyssesAttention(groups.group, sp)
    local = [_seq_shard(t, groups.sp_rank, sp) for t in (q, k, v, grad_out)]
    out, stats = core.forward(*local[:3], traits)
    dq, dk, dv, dsinks = core.backward(local[3], *local[:3], out, stats, traits)
    others = dsinks.clone()
    mine = HeadSplit(heads, kv_heads, sp).query(groups.sp_rank)
    others[mine.start : mine.stop] = 0
    dist.all_reduce(dsinks, group=groups.group)
    errors = {
        n: _max_error(g, _seq_shard(w, groups.sp_rank, sp))
        for n, g, w in zip(["out", "dq", "dk", "dv"], (out, dq, dk, dv), wants)
    }
    return {**errors, "dsinks": _max_error(dsinks, wants[4]), "dsinks_of_other_heads": others.abs().max().item()}


def _sink_attention(module, query, key, value, attention_mask, scaling, s_aux, **kwargs):
    """A transformers attention implementation that reads the sinks from ``s_aux`` (as flash-attention 3 does)."""
    groups = module.num_key_value_groups
    scores = query @ key.repeat_interleave(groups, 1).transpose(-1, -2) * scaling
    scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), -torch.inf)
    sinks = s_aux.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sinks], -1).softmax(-1)[..., :-1]
    return (probs @ value.repeat_interleave(groups, 1)).transpose(1, 2), None


def _autograd_attention_with_traits(groups, sp, heads, kv_heads, seed):
    """Ulysses for the non-memo modes: sdpa beyond its sliding window (against sdpa with transformers' sliding mask
    on the whole sequence), and an implementation reading the sinks from ``s_aux``, which reaches it sliced to the
    rank's heads (the group's sinks gradients add up to the whole one)."""
    AttentionInterface.register("hf_memo_test_sinks", _sink_attention)
    module = torch.nn.Module()
    module.config, module.num_key_value_groups, module.is_causal = SimpleNamespace(), heads // kv_heads, True
    q, grad_out = _full((BATCH, heads, SEQ, DIM), seed + 11), _full((BATCH, SEQ, heads, DIM), seed + 12)
    k, v = (_full((BATCH, kv_heads, SEQ, DIM), seed + s) for s in (13, 14))
    sinks = _full((heads,), seed + 15)
    mask = eager_mask(BATCH, SEQ, SEQ, mask_function=sliding_window_causal_mask_function(5), dtype=torch.float64)
    errors = {}
    for inner, extra in (("sdpa", {"sliding_window": 5}), ("hf_memo_test_sinks", {"s_aux": sinks})):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        whole = {**extra, "s_aux": leaves[3]} if "s_aux" in extra else extra
        reference = sdpa_attention_forward if inner == "sdpa" else _sink_attention
        module.num_key_value_groups = heads // kv_heads
        want, _ = reference(module, *leaves[:3], mask if inner == "sdpa" else None, scaling=0.4, **whole)
        want.backward(grad_out)
        local = [_seq_shard(t, groups.sp_rank, sp).detach().requires_grad_(True) for t in (q, k, v)]
        local_sinks = sinks.clone().requires_grad_(True)
        mine = {**extra, "s_aux": local_sinks} if "s_aux" in extra else extra
        module.training = True
        out, _ = ulysses_attention(module, *local, None, inner=inner, sp_size=sp, scaling=0.4, **mine)
        out.backward(grad_out[:, groups.sp_rank * SEQ // sp : (groups.sp_rank + 1) * SEQ // sp])
        errors[f"{inner}-out"] = _max_error(
            out, want.detach()[:, groups.sp_rank * SEQ // sp : (groups.sp_rank + 1) * SEQ // sp]
        )
        for name, got, leaf in zip("qkv", local, leaves):
            errors[f"{inner}-d{name}"] = _max_error(got.grad, _seq_shard(leaf.grad, groups.sp_rank, sp))
        if "s_aux" in extra:
            dist.all_reduce(local_sinks.grad, group=groups.group)
            errors[f"{inner}-dsinks"] = _max_error(local_sinks.grad, leaves[3].grad)
    return errors


def assert_exact(per_rank: list[dict], degrees) -> None:
    """Every check below 1e-12 (fp64) on every rank, and every shape and degree checked."""
    checked = set()
    for rank, results in enumerate(per_rank):
        for case, errors in results.items():
            for name, error in errors.items():
                assert error < 1e-12, f"rank {rank}, {case}: {name} differs by {error}"
            checked.add(case)
    for sp in degrees:
        assert {f"sp{sp}-h{h}-kv{kv}" for h, kv in HEAD_SHAPES if h >= sp} <= checked
        assert {f"sp{sp}-h{h}-memo-traits" for h, _ in TRAIT_SHAPES} <= checked


def test_exchange_and_attention_core_on_four_ranks():
    """Four ranks: one group of 4, and two replicas of 2 with different data. KV heads 1, 2, 4, 8 for 8 query
    heads (sp > kv, one per rank, several per rank), and uneven splits: 6 query heads in 2 groups of 3 (a group
    straddles ranks), 5 heads without GQA, 10 heads in 2 groups of 5."""
    assert_exact(run_processes(_exchange_worker, 4), (4, 2))
