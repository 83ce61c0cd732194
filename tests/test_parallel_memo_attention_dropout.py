"""The sequence-parallel memo attention core passes attention dropout through to the local core and replays the
mask in backward (a one-rank group: the exchanges are the identity, the rest is the real code path)."""

import torch

from hf_memo.parallel import collectives
from hf_memo.parallel.memo_attention import UlyssesAttention
from hf_memo.runtime.attention_core import expand_kv
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.dropout_attention import keep_mask

BATCH, HEADS, KV_HEADS, SEQ, DIM, SCALE, P = 2, 4, 2, 12, 8, 0.3, 0.25


def test_dropout_reaches_the_core_and_its_mask_is_replayed(monkeypatch):
    monkeypatch.setattr(collectives.dist, "get_world_size", lambda group=None: 1)
    gen = torch.Generator().manual_seed(0)
    q, upstream = (torch.randn(BATCH, HEADS, SEQ, DIM, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(BATCH, KV_HEADS, SEQ, DIM, dtype=torch.float64, generator=gen) for _ in range(2))
    core = UlyssesAttention(group=None, size=1)
    traits = AttentionTraits(SCALE, P)
    out, stats = core.forward(q, k, v, traits)
    *grads, dsinks = core.backward(upstream, q, k, v, out, stats, traits)
    assert dsinks is None
    assert stats.dropout_p == P
    keep = keep_mask(stats.extra[0], P, BATCH, HEADS, SEQ, (0, SEQ), SEQ, q.device)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    scores = leaves[0] @ expand_kv(leaves[1], 2).transpose(-1, -2) * SCALE
    scores = scores.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
    want = (scores.softmax(-1) * keep / (1 - P)) @ expand_kv(leaves[2], 2)
    want.backward(upstream)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)
