"""Ulysses head/sequence exchange: layout, round trip, GQA replication, autograd, and an attention core run
as an explicit forward/backward pair (as a layer executor calls it) against plain full-sequence attention."""

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
from hf_memo.parallel.memo_attention import UlyssesAttention
from hf_memo.parallel.ulysses import (
    gather_heads_scatter_sequence,
    replicate_kv_heads,
    replicated_kv_heads,
    scatter_heads_gather_sequence,
    scatter_heads_gather_sequence_differentiable,
    sum_replicated_kv_heads,
)
from hf_memo.runtime.attention_core import attention_backward, attention_forward
from hf_memo.runtime.attention_traits import AttentionTraits
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
        results[f"sp{sp}-memo-traits"] = _memo_core_with_traits(groups, sp, seed)
        results[f"sp{sp}-autograd-traits"] = _autograd_attention_with_traits(groups, sp, seed)
    return results


def _max_error(got, want):
    return (got - want).abs().max().item()


def _memo_core_with_traits(groups, sp, seed):
    """The memo executor's Ulysses core with a window, soft-capped scores and sinks against the local core on the
    whole sequence: each rank's dsinks is its heads' share (zero elsewhere), the group's sum the whole gradient."""
    q, grad_out = _full((BATCH, HEADS, SEQ, DIM), seed + 6), _full((BATCH, HEADS, SEQ, DIM), seed + 7)
    k, v = (_full((BATCH, 2, SEQ, DIM), seed + s) for s in (8, 9))
    traits = AttentionTraits(0.4, window=5, softcap=2.0, sinks=_full((HEADS,), seed + 10))
    want_out, want_stats = attention_forward(q, k, v, traits)
    wants = (want_out, *attention_backward(grad_out, q, k, v, want_out, want_stats, traits))
    core = UlyssesAttention(groups.group, sp)
    local = [_seq_shard(t, groups.sp_rank, sp) for t in (q, k, v, grad_out)]
    out, stats = core.forward(*local[:3], traits)
    dq, dk, dv, dsinks = core.backward(local[3], *local[:3], out, stats, traits)
    others = dsinks.clone()
    others[groups.sp_rank * HEADS // sp : (groups.sp_rank + 1) * HEADS // sp] = 0
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


def _autograd_attention_with_traits(groups, sp, seed):
    """Ulysses for the non-memo modes: sdpa beyond its sliding window (against sdpa with transformers' sliding mask
    on the whole sequence), and an implementation reading the sinks from ``s_aux``, which reaches it sliced to the
    rank's heads (the group's sinks gradients add up to the whole one)."""
    AttentionInterface.register("hf_memo_test_sinks", _sink_attention)
    module = torch.nn.Module()
    module.config, module.num_key_value_groups, module.is_causal = SimpleNamespace(), HEADS // 2, True
    q, grad_out = _full((BATCH, HEADS, SEQ, DIM), seed + 11), _full((BATCH, SEQ, HEADS, DIM), seed + 12)
    k, v = (_full((BATCH, 2, SEQ, DIM), seed + s) for s in (13, 14))
    sinks = _full((HEADS,), seed + 15)
    mask = eager_mask(BATCH, SEQ, SEQ, mask_function=sliding_window_causal_mask_function(5), dtype=torch.float64)
    errors = {}
    for inner, extra in (("sdpa", {"sliding_window": 5}), ("hf_memo_test_sinks", {"s_aux": sinks})):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        whole = {**extra, "s_aux": leaves[3]} if "s_aux" in extra else extra
        reference = sdpa_attention_forward if inner == "sdpa" else _sink_attention
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
    assert checked == 4 * (2 * 4 + 4 * 5 + 4 * 5 + 2 * 6 + 2 * 9)
