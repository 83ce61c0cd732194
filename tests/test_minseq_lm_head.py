import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_memo.minseq.lm_head import causal_lm_loss, linear_cross_entropy, shifted_targets
from tests.conftest import ShapeRecorder


def _reference(hidden, head, targets, num_items=None):
    loss = nn.functional.cross_entropy(head(hidden).float(), targets, ignore_index=-100, reduction="sum")
    denominator = num_items if num_items is not None else (targets != -100).sum()
    return loss / denominator


def _loss_and_grads(fn, hidden, head, scale=1.0):
    head.zero_grad()
    hidden = hidden.detach().requires_grad_(True)
    loss = fn(hidden)
    (loss * scale).backward()
    return loss.detach(), [hidden.grad] + [p.grad for p in head.parameters()]


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(1, 60),
    hidden_size=st.integers(1, 10),
    vocab=st.integers(2, 50),
    chunks=st.integers(1, 17),
    masked=st.floats(0.0, 0.9),
    bias=st.booleans(),
    use_num_items=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_loss_and_gradients_equal_full_cross_entropy(
    rows, hidden_size, vocab, chunks, masked, bias, use_num_items, seed
):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = nn.Linear(hidden_size, vocab, bias=bias).double()
    hidden = torch.randn(rows, hidden_size, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[torch.rand(rows, generator=gen) < masked] = -100
    targets[0] = 0  # at least one counted token, so the mean is defined
    num_items = torch.tensor(rows + 3) if use_num_items else None
    ref_loss, ref_grads = _loss_and_grads(lambda h: _reference(h, head, targets, num_items), hidden, head)
    loss, grads = _loss_and_grads(
        lambda h: linear_cross_entropy(h, head, list(head.parameters()), targets, chunks, num_items_in_batch=num_items),
        hidden,
        head,
    )
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scale", [0.7, 3.0, 1 / 16])
def test_upstream_gradient_scales_every_gradient(scale):
    torch.manual_seed(0)
    head = nn.Linear(7, 23).double()
    hidden = torch.randn(31, 7, dtype=torch.float64)
    targets = torch.randint(0, 23, (31,))
    targets[::5] = -100
    _, ref_grads = _loss_and_grads(lambda h: _reference(h, head, targets), hidden, head, scale=scale)
    _, grads = _loss_and_grads(
        lambda h: linear_cross_entropy(h, head, list(head.parameters()), targets, 6), hidden, head, scale=scale
    )
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_full_logits_never_exist():
    rows, hidden_size, vocab, chunks = 64, 8, 200, 8
    head = nn.Linear(hidden_size, vocab, bias=False).double()
    hidden = torch.randn(rows, hidden_size, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    with ShapeRecorder() as recorder:
        linear_cross_entropy(hidden, head, [head.weight], targets, chunks).backward()
    logit_rows = [s[0] for s in recorder.shapes if len(s) == 2 and s[1] == vocab]
    assert logit_rows and max(logit_rows) == rows // chunks
    assert recorder.largest() == vocab * hidden_size  # the weight gradient, not logits


def test_weight_gradient_is_not_doubled_and_hooks_fire_once():
    head = nn.Linear(6, 30, bias=False).double()
    fired = []
    head.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    hidden = torch.randn(25, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (25,))
    linear_cross_entropy(hidden, head, [head.weight], targets, 4).backward()
    expected = torch.autograd.grad(_reference(hidden, head, targets), head.weight)[0]
    assert len(fired) == 1
    torch.testing.assert_close(head.weight.grad, expected, rtol=1e-10, atol=1e-13)


def test_frozen_head_gets_no_gradient_but_hidden_does():
    head = nn.Linear(6, 30).double().requires_grad_(False)
    hidden = torch.randn(25, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (25,))
    linear_cross_entropy(hidden, head, [], targets, 3).backward()
    assert head.weight.grad is None and head.bias.grad is None
    expected = torch.autograd.grad(_reference(hidden, head, targets), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-10, atol=1e-13)


def test_tied_embedding_and_head_accumulate_both_paths():
    torch.manual_seed(0)
    embed = nn.Embedding(40, 8).double()
    ids = torch.randint(0, 40, (2, 11))
    targets = torch.randint(0, 40, (22,))
    targets[::4] = -100

    def run(chunked):
        embed.zero_grad()
        hidden = torch.tanh(embed(ids)).reshape(-1, 8)
        head = lambda h: h @ embed.weight.T  # noqa: E731 - the tied head
        loss = (
            linear_cross_entropy(hidden, head, [embed.weight], targets, 5)
            if chunked
            else _reference(hidden, head, targets)
        )
        loss.backward()
        return embed.weight.grad.clone()

    torch.testing.assert_close(run(True), run(False), rtol=1e-10, atol=1e-13)


def test_causal_lm_loss_matches_transformers_loss_with_every_option():
    torch.manual_seed(0)
    batch, seq, hidden_size, vocab = 3, 13, 8, 37
    head = nn.Linear(hidden_size, vocab, bias=False).double()
    hidden = torch.randn(batch, seq, hidden_size, dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, seq))
    labels[1, :7] = -100
    labels[2] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(50)}, {"shift_labels": shifted_targets(labels)}):
        ref_loss, ref_grads = _loss_and_grads(
            lambda h, kw=kwargs: ForCausalLMLoss(head(h), labels, vocab, **kw), hidden, head
        )
        loss, grads = _loss_and_grads(
            lambda h, kw=kwargs: causal_lm_loss(h, head, [head.weight], labels, 4, **kw), hidden, head
        )
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_shifted_targets_drop_nothing_but_the_last_position():
    labels = torch.tensor([[5, 6, 7, 8], [1, -100, 3, 4]])
    assert shifted_targets(labels).tolist() == [[6, 7, 8, -100], [-100, 3, 4, -100]]


def test_no_grad_path_returns_the_same_loss():
    head = nn.Linear(6, 30).double()
    hidden = torch.randn(25, 6, dtype=torch.float64)
    targets = torch.randint(0, 30, (25,))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, head, list(head.parameters()), targets, 4)
    torch.testing.assert_close(loss, _reference(hidden, head, targets), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_head_gradients_track_the_float32_reference(dtype):
    torch.manual_seed(0)
    head = nn.Linear(32, 300, bias=False)
    hidden = torch.randn(256, 32)
    targets = torch.randint(0, 300, (256,))
    _, exact = _loss_and_grads(lambda h: _reference(h, head, targets), hidden, head)
    half_head = nn.Linear(32, 300, bias=False).to(dtype)
    half_head.weight.data.copy_(head.weight.data)
    ref_loss, ref_grads = _loss_and_grads(lambda h: _reference(h, half_head, targets), hidden.to(dtype), half_head)
    loss, grads = _loss_and_grads(
        lambda h: linear_cross_entropy(h, half_head, [half_head.weight], targets, 16), hidden.to(dtype), half_head
    )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    # Each chunk's partial gradient is rounded once to the head's dtype before the float32 sum: the error
    # stays within one rounding unit of the largest gradient and within 2x the unchunked half matmul's.
    ref_err = (ref_grads[1].float() - exact[1]).abs().max()
    err = (grads[1].float() - exact[1]).abs().max()
    assert err <= torch.finfo(dtype).eps * exact[1].abs().max()
    assert err <= 2 * ref_err
