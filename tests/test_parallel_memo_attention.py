"""The sequence-parallel memo attention core frees the shards it has exchanged before its inner core's backward."""

import gc
import weakref

import torch

from hf_memo.parallel.memo_attention import UlyssesAttention
from hf_memo.runtime.attention_core import AttentionStats
from hf_memo.runtime.attention_traits import AttentionTraits

BATCH, HEADS, KV_HEADS, SEQ, DIM = 1, 4, 2, 8, 16


class _Spy:
    """An inner core that records which of ``watched`` are alive when its backward is called."""

    def __init__(self, watched):
        self.watched, self.alive = watched, None

    def backward(self, grad_out, q, k, v, out, stats, traits):
        gc.collect()
        self.alive = [ref() is not None for ref in self.watched]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


def _shard(heads):
    """``(B, h, S / sp, D)`` as the executor hands it over: a view of ``(B, S / sp, h, D)`` memory."""
    return torch.randn(BATCH, SEQ, heads, DIM, dtype=torch.bfloat16).transpose(1, 2)


def test_each_exchanged_shard_the_caller_no_longer_holds_is_freed_before_the_inner_backward(fake_world):
    group = fake_world(2)
    tensors = [_shard(HEADS), _shard(HEADS), _shard(KV_HEADS), _shard(KV_HEADS), _shard(HEADS)]
    spy = _Spy([weakref.ref(t) for t in tensors])
    stats = AttentionStats(torch.zeros(BATCH, HEADS // 2, 2 * SEQ))
    dq, dk, dv, dsinks = UlyssesAttention(group, 2, spy).backward_releasing(tensors, stats, AttentionTraits(0.25))
    assert tensors == [None] * 5 and spy.alive == [False] * 5
    assert dq.shape == (BATCH, HEADS, SEQ, DIM) and dk.shape == dv.shape == (BATCH, KV_HEADS, SEQ, DIM)
    assert dsinks is None


def test_a_shard_the_caller_still_holds_stays(fake_world):
    group = fake_world(2)
    held = [_shard(HEADS), _shard(HEADS), _shard(KV_HEADS), _shard(KV_HEADS), _shard(HEADS)]
    spy = _Spy([weakref.ref(t) for t in held])
    stats = AttentionStats(torch.zeros(BATCH, HEADS // 2, 2 * SEQ))
    UlyssesAttention(group, 2, spy).backward(*held, stats, AttentionTraits(0.25))
    assert spy.alive == [True] * 5
