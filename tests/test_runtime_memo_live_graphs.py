"""Several graphs alive at once through a memo model, and graphs differentiated more than once.

Forwards before their backwards (pipeline schedules, "forward all micro-batches, then backward each",
losses that run the model twice) and ``retain_graph=True`` must give the unpatched model's gradients
in every backward order: each graph's backward fetches its own stashes, and a device slot taken by
another graph's stash is fetched again by the one that lost it.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import hf_memo
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from tests.conftest import assert_same_grads, build_model, make_batch

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off", "deferred_copies")

LAYERS = 6
# Every kind of layer: X only and X + attention, on the host and on the device, several alphas.
MIXED = MemoryPolicy(
    (
        LayerPolicy(keep_attention=False, on_host=True, alpha=0.5),
        LayerPolicy(keep_attention=True, on_host=True, alpha=1.0),
        LayerPolicy(keep_attention=True, on_host=True, alpha=0.0),
        LayerPolicy(keep_attention=False, on_host=True, alpha=0.0),
        LayerPolicy(keep_attention=True, on_host=False, alpha=1 / 3),
        LayerPolicy(keep_attention=False, on_host=False, alpha=1.0),
    )
)
POLICIES = {"offload 0": 0.0, "offload 0.5": 0.5, "offload 1": 1.0, "mixed": MIXED}


def _models(policy, planner: str = "off"):
    reference = build_model("llama", num_hidden_layers=LAYERS)
    fraction = policy if isinstance(policy, float) else "auto"
    model = hf_memo.apply(
        copy.deepcopy(reference),
        recompute="memo",
        offload_fraction=fraction,
        mlp_chunks=3,
        lm_head_chunks=2,
        planner=planner,
    )
    if isinstance(policy, MemoryPolicy):
        hf_memo.memo_runtime(model).assume_policy(policy)
    return model, reference


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_batch(2, 13 + 2 * i, seed=i) for i in range(count)]  # a shape per graph: 13, 15, 17 tokens


def _reference_grads(reference, batches) -> None:
    for ids, labels in batches:
        reference(input_ids=ids, labels=labels).loss.backward()


# Three graphs' six orders hold every order of two of them: the planner's greedy arena runs them only
@pytest.mark.parametrize(
    "graphs,planner,policy",
    [(graphs, "off", policy) for graphs in (2, 3) for policy in POLICIES]
    # the planner's arena: the mixed policy holds every kind of layer; offload 0.5 host and device layers of one alpha
    + [(3, "greedy", policy) for policy in ("offload 0.5", "mixed")],
)
def test_live_graphs_give_the_unpatched_gradients_in_every_backward_order(graphs, policy, planner):
    model, reference = _models(POLICIES[policy], planner)
    batches = _batches(graphs)
    _reference_grads(reference, batches)
    runtime = hf_memo.memo_runtime(model)
    for order in itertools.permutations(range(graphs)):
        model.zero_grad(set_to_none=True)
        losses = [model(input_ids=ids, labels=labels).loss for ids, labels in batches]
        for index in order:
            losses[index].backward()
        assert_same_grads(model, reference, rtol=1e-9, atol=1e-12)
        del losses
        assert all(t.pool.in_use_bytes == 0 for t in runtime._transports.values())  # every host buffer returned
    assert runtime.host_reserved_bytes > 0  # the layers on the host did swap


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_retained_graph_is_differentiated_again_exactly(policy):
    model, reference = _models(POLICIES[policy])
    (ids, labels), (ids2, labels2) = _batches(2)
    runtime = hf_memo.memo_runtime(model)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward(retain_graph=True)
    pools = list(runtime._transports.values())
    assert sum(t.pool.in_use_bytes for t in pools) > 0  # the host copies stay for the next backward
    (0.5 * out.loss).backward(retain_graph=True)
    other = model(input_ids=ids2, labels=labels2).loss  # a second graph between two backwards of the first
    (0.25 * out.loss).backward()
    other.backward()
    assert sum(t.pool.in_use_bytes for t in pools) == 0
    ref_loss = reference(input_ids=ids, labels=labels).loss  # float32 (HF's loss): the same three backwards
    ref_loss.backward(retain_graph=True)
    (0.5 * ref_loss).backward(retain_graph=True)
    (0.25 * ref_loss).backward()
    reference(input_ids=ids2, labels=labels2).loss.backward()
    assert_same_grads(model, reference, rtol=1e-9, atol=1e-12)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.loss.backward()  # freed by the last backward: PyTorch's own message


def test_a_graph_kept_across_no_grad_eval_and_generate_forwards_is_exact():
    model, reference = _models(0.5)
    (ids, labels), (ids2, labels2) = _batches(2)
    _reference_grads(reference, [(ids, labels)])
    kept = model(input_ids=ids, labels=labels).loss
    with torch.no_grad():
        model(input_ids=ids2, labels=labels2)
    detached = model(input_ids=ids2, labels=labels2).loss.detach()  # a reference loss, graph dropped at once
    model.eval()
    model(input_ids=ids2, labels=labels2)
    model.generate(ids2[:1, :5], max_new_tokens=3, do_sample=False)
    model.train()
    kept.backward()
    assert torch.isfinite(detached)
    assert_same_grads(model, reference, rtol=1e-9, atol=1e-12)
