import copy

import pytest
import torch

import hf_memo
from hf_memo.config import MemoConfig
from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.patches.layer_split import split_layer
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.calibration import layer_bytes_per_token
from hf_memo.runtime.head_offload import head_input_offloaded
from hf_memo.runtime.memo import MemoRuntime
from tests.conftest import assert_same_grads, build_model, make_batch

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off")

SEQ, HIDDEN = 24, 32


def _runtime(**config) -> MemoRuntime:
    """A memo runtime that has planned layers of input shape ``(2, SEQ, HIDDEN)`` in float64."""
    runtime = MemoRuntime(MemoConfig(recompute="memo", **config), num_layers=4)
    model = build_model("llama")
    x = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64)
    split = split_layer(
        model.model.layers[0], x, position_embeddings=model.model.rotary_emb(x, torch.arange(SEQ)[None])
    )
    runtime.alpha_chunks(split, x, chunk_bounds(x.shape[1], 4), LocalAttention, 0)
    return runtime


def _pool(runtime: MemoRuntime):
    return runtime._transport(torch.device("cpu")).pool


def _loss(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ w).sum()  # saves h (for w's gradient) and tanh's output


def _grads(hidden: torch.Tensor, w: torch.Tensor, runtime: MemoRuntime | None, clobber: bool):
    hidden, w = hidden.clone().requires_grad_(), w.clone().requires_grad_()
    with head_input_offloaded(runtime, hidden) as h:
        loss = _loss(h, w)
    if clobber:
        hidden.data.add_(1.0)  # what backward reads must be the stash's copy, not this storage
    in_use = None if runtime is None else _pool(runtime).in_use_bytes
    loss.backward()
    return hidden.grad, w.grad, in_use


def test_the_head_input_waits_on_the_host_and_gives_exact_gradients():
    runtime = _runtime(offload_fraction=0.0)
    hidden, w = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64), torch.randn(HIDDEN, 5, dtype=torch.float64)
    want_hidden, want_w, _ = _grads(hidden, w, None, clobber=False)
    got_hidden, got_w, in_use = _grads(hidden, w, runtime, clobber=True)
    assert in_use >= hidden.numel() * hidden.element_size()
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)
    torch.testing.assert_close(got_hidden, want_hidden, rtol=0, atol=0)
    assert _pool(runtime).in_use_bytes == 0  # released by the backward


def test_the_device_copy_of_the_head_input_is_freed_while_the_graph_lives():
    runtime = _runtime(offload_fraction=0.0)
    leaf = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    w = torch.randn(HIDDEN, 5, dtype=torch.float64, requires_grad=True)
    hidden = leaf * 2
    storage = hidden.untyped_storage()._weak_ref()
    with head_input_offloaded(runtime, hidden) as h:
        loss = _loss(h, w)
    del hidden, h
    assert not torch.UntypedStorage._expired(storage)  # held while its copy to the host may run
    freed = []
    w.register_hook(lambda grad: freed.append(torch.UntypedStorage._expired(storage)))
    got = torch.autograd.grad(loss, [leaf, w])
    assert freed == [True]  # the copy waited on when backward began: only the host copy is left for it
    want = torch.autograd.grad(_loss(leaf * 2, w), [leaf, w])
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_the_head_input_goes_to_the_host_only_beside_host_layers_with_room_left():
    hidden = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    hidden_bytes = hidden.numel() * hidden.element_size()
    model = build_model("llama")
    split = split_layer(
        model.model.layers[0], hidden, position_embeddings=model.model.rotary_emb(hidden, torch.arange(SEQ)[None])
    )
    layer_bytes = round(layer_bytes_per_token(split, hidden.detach()).fixed * hidden.shape[0] * SEQ)  # alpha 0
    limits = {"fits": layer_bytes + hidden_bytes, "too small": layer_bytes + hidden_bytes - 1, "no layer": hidden_bytes}
    swapped = {"fits": 1, "too small": 1, "no layer": 0}
    runtimes = {}
    for name, limit in limits.items():
        with pytest.warns(UserWarning, match=f"{swapped[name]} of 2 layers"):
            runtimes[name] = _runtime(offload_fraction=0.0, host_memory_limit=f"{limit}B")
    assert runtimes["fits"].open_head_stash(hidden) is not None
    assert runtimes["too small"].open_head_stash(hidden) is None
    assert runtimes["no layer"].open_head_stash(hidden) is None  # every layer on the device: the step fits there


def test_the_head_input_is_not_offloaded_for_another_shape_or_without_a_graph():
    runtime = _runtime(offload_fraction=0.0)
    other_shape = torch.randn(1, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    assert runtime.open_head_stash(other_shape) is None
    hidden = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    with torch.no_grad(), head_input_offloaded(runtime, hidden) as h:
        assert h is hidden
    assert _pool(runtime).reserved_bytes == 0


def test_a_memo_model_offloads_its_head_input_every_step_and_matches_unpatched(monkeypatch):
    opened = []
    original = MemoRuntime.open_head_stash

    def spy(self, hidden):
        stash = original(self, hidden)
        opened.append(stash is not None)
        return stash

    monkeypatch.setattr(MemoRuntime, "open_head_stash", spy)
    model = build_model("llama", num_hidden_layers=3)
    reference = copy.deepcopy(model)
    hf_memo.apply(model, recompute="memo", offload_fraction=0.0, mlp_chunks=4, lm_head_chunks=3)
    for seed in range(2):
        ids, labels = make_batch(2, 17, seed=seed)
        loss, want = model(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss
        loss.backward(), want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)  # the loss is float32
    assert opened == [True, True]
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
