"""Recomputation in backward casts each weight once under autocast, however many chunks it recomputes.

Leaving the outermost ``torch.autocast`` empties autocast's weight-cast cache; a backward that replayed each
chunk in an autocast region of its own would cast every fp32 weight to bf16 once per chunk.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_memo
from hf_memo.minseq.recompute import run_chunked
from hf_memo.minseq.replay import ReplayState, autocast_cache_kept
from tests.conftest import build_model, make_batch


class WeightCasts(TorchDispatchMode):
    """Counts the casts (``aten._to_copy``) of each of ``weights`` while active."""

    def __init__(self, weights) -> None:
        super().__init__()
        self.pointers = {w.data_ptr() for w in weights}
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.pointers:
            self.counts[args[0].data_ptr()] += 1
        return func(*args, **(kwargs or {}))


def test_run_chunked_casts_each_weight_once_per_backward():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(24, 8, requires_grad=True)
    params = list(mlp.parameters())
    bounds = [(0, 6), (6, 12), (12, 18), (18, 24)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_chunked(lambda rows, start, stop: mlp(rows), x, params, bounds, "cat")
    with WeightCasts(params) as casts:
        out.float().sum().backward()
    assert len(casts.counts) == len(params) and set(casts.counts.values()) == {1}  # not 4 (one per chunk)


@pytest.mark.parametrize("recompute", ["memo", "none"])
def test_a_memo_layer_backward_casts_each_weight_once(recompute):
    model = build_model("llama", dtype=torch.float32, num_hidden_layers=2)
    extra = {"offload_fraction": 0.5} if recompute == "memo" else {}
    hf_memo.apply(model, recompute=recompute, mlp_chunks=4, lm_head_chunks=3, **extra)
    ids, labels = make_batch(2, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=labels).loss
    with WeightCasts(model.parameters()) as casts:
        loss.backward()
    assert casts.counts and max(casts.counts.values()) == 1


def test_autocast_cache_kept_leaves_the_callers_autocast_state_as_it_was():
    replay = ReplayState.capture(torch.device("cpu"))
    with autocast_cache_kept(torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inner = ReplayState.capture(torch.device("cpu"))
        with inner.replay():
            assert torch.is_autocast_enabled("cpu")
        assert not torch.is_autocast_enabled("cpu")
    assert not replay.autocast_enabled
