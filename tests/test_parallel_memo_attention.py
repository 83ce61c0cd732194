"""The sequence-parallel memo attention core: it frees the shards it has exchanged before its inner core's backward,
and a layer's backward in chunks of queries over keys exchanged once matches the unpatched model."""

import gc
import weakref
from dataclasses import replace

import pytest
import torch

import hf_memo
from hf_memo.parallel.memo_attention import ExchangedQueryBlocks, UlyssesAttention
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.runtime.attention_core import AttentionStats
from hf_memo.runtime.attention_traits import AttentionTraits
from tests.conftest import make_batch
from tests.multiprocess import run_processes
from tests.test_parallel_causal_lm import Case, _averaged_grads, _build, _compare

pytestmark = pytest.mark.usefixtures("deferred_copies")  # copies carried out late, as CUDA may

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


# The layers' backward one chunk of queries at a time over keys exchanged once (ExchangedQueryBlocks), on real
# gloo ranks against the unpatched model: both kinds of layer (input only, input and attention), on the host and
# on the device, alpha 0 to 1, chunk counts that do not divide the rank's positions, uneven heads with KV heads
# repeated after the exchange, soft-capped scores and sinks, masked labels and two steps of accumulated gradients.
# (Degree 3, and more drawn configurations: ``python -m tests.randomized_sequence_parallel``.)
X_ONLY, X_ATTN = LayerPolicy(keep_attention=False), LayerPolicy(keep_attention=True)
SP = 2
# 9 query heads in 3 groups of 3: at sp=2 rank 0 attends with heads 0-4, so the group of KV head 1 straddles ranks
NINE_HEADS = dict(hidden_size=36, num_attention_heads=9, num_key_value_heads=3)


def _held_keys_cases() -> dict[str, Case]:
    input_only = [replace(X_ONLY, on_host=False), replace(X_ONLY, alpha=0.5), replace(X_ONLY, on_host=False, alpha=1.0)]
    mixed = [X_ATTN, replace(X_ONLY, alpha=0.5), replace(X_ATTN, on_host=False, alpha=1.0)]
    catalog = {"recompute": "memo", "mlp_chunks": 3, "policy": MemoryPolicy((X_ONLY, *mixed[1:]))}
    return {
        "llama, input only, alpha 0 to 1": Case(
            "llama",
            *make_batch(2, 17, 0.3),
            overrides={"num_hidden_layers": 3},
            memo={"recompute": "memo", "mlp_chunks": 3, "policy": MemoryPolicy(tuple(input_only))},
        ),
        "llama, 9 heads in 3 groups (KV repeated), both kinds": Case(
            "llama",
            *make_batch(2, 17, 0.3),
            overrides={"num_hidden_layers": 3, **NINE_HEADS},
            memo={"recompute": "memo", "mlp_chunks": 3, "policy": MemoryPolicy(tuple(mixed))},
        ),
        "gemma2 (soft-cap)": Case("gemma2", *make_batch(2, 21), memo=catalog, catalog=True),
        "gpt_oss (sinks)": Case(
            "gpt_oss", *make_batch(2, 21), overrides={"output_router_logits": False}, memo=catalog, catalog=True
        ),
    }


def _held_keys_step(case: Case, sp: int, counted: list[int]) -> dict:
    model = _build(case)
    memo = dict(case.memo)
    policy = memo.pop("policy")
    hf_memo.apply(model, sequence_parallel_size=sp, lm_head_chunks=2, **memo)
    hf_memo.memo_runtime(model).assume_policy(MemoryPolicy(policy.layers[: model.config.num_hidden_layers]))
    before = counted[0]
    loss = None
    for half in (slice(0, 1), slice(1, 2)):  # gradient accumulation over the two rows
        step = model(input_ids=case.ids[half], labels=case.labels[half]).loss
        step.backward()
        loss = step.detach() if loss is None else loss + step.detach()
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    blocked = sum(kind != "sliding_attention" for kind in types)  # a window shorter than S is not blocked
    assert counted[0] - before == 2 * blocked, f"{counted[0] - before} layer backwards in held-key blocks"
    return {"loss": loss, "grads": _averaged_grads(model)}


def _held_keys_worker(rank, world):
    counted = [0]
    original = ExchangedQueryBlocks.key_grads

    def counting(self):
        counted[0] += 1
        return original(self)

    ExchangedQueryBlocks.key_grads = counting
    return {name: _held_keys_step(case, world, counted) for name, case in _held_keys_cases().items()}


def _accumulated_reference(case: Case) -> tuple[torch.Tensor, dict]:
    model = _build(case)
    loss = 0
    for half in (slice(0, 1), slice(1, 2)):
        step = model(input_ids=case.ids[half], labels=case.labels[half], use_cache=False).loss
        step.backward()
        loss = loss + step.detach()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def test_layers_run_their_backward_in_held_key_blocks_and_match_the_unpatched_model():
    per_rank = run_processes(_held_keys_worker, SP)
    failures = []
    for name, case in _held_keys_cases().items():
        loss, grads = _accumulated_reference(case)
        for rank, results in enumerate(per_rank):
            try:
                _compare(results[name], loss, grads, case)
            except AssertionError as error:
                failures.append(f"{name}, rank {rank}: {error}")
    assert not failures, "\n".join(failures)
