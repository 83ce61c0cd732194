"""run_chunked with several outputs per chunk (a mixture-of-experts block's hidden states and router logits)."""

import pytest
import torch

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.minseq.recompute import run_chunked

ROWS, HIDDEN, EXPERTS = 11, 6, 4


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in [(HIDDEN, 9), (9, HIDDEN)]]


def _two_outputs(w1, w2):
    """Rows -> (per-row output (n, H), per-row 'logits' (n, E) read from the intermediate, argmax ids (n,))."""

    def fn(rows, _start, _stop):
        h = torch.tanh(rows @ w1)
        return h @ w2, h[:, :EXPERTS] * 2, h.argmax(-1)

    return fn


def _grads(outputs, upstreams, inputs):
    used = [(o, u) for o, u in zip(outputs, upstreams) if u is not None]
    grads = torch.autograd.grad([o for o, _ in used], inputs, [u for _, u in used], allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs)]


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("used", ["both", "first", "second"])
def test_every_output_is_concatenated_and_differentiated_like_the_unchunked_call(chunks, used):
    w1, w2 = _weights()
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)
    fn = _two_outputs(w1, w2)
    want = fn(x, 0, ROWS)
    got = run_chunked(fn, x, [w1, w2], chunk_bounds(ROWS, chunks), "cat")
    assert isinstance(got, tuple) and len(got) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-15)
    assert got[2].dtype == torch.int64 and not got[2].requires_grad
    up = [torch.randn_like(want[0]), torch.randn_like(want[1])]
    up = [up[0] if used != "second" else None, up[1] if used != "first" else None]
    for g, w in zip(_grads(got[:2], up, [x, w1, w2]), _grads(want[:2], up, [x, w1, w2])):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_sum_reduces_each_output_of_a_tuple():
    w1, w2 = _weights(1)
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)

    def fn(rows, _start, _stop):
        h = torch.tanh(rows @ w1) @ w2
        return h.sum(), h.pow(2).sum()

    got = run_chunked(fn, x, [w1, w2], chunk_bounds(ROWS, 3), "sum")
    want = fn(x, 0, ROWS)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0)
    grads = torch.autograd.grad(got[0] + 3 * got[1], [x, w1, w2])
    for g, w in zip(grads, torch.autograd.grad(want[0] + 3 * want[1], [x, w1, w2])):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_a_single_tensor_stays_a_single_tensor_on_every_path():
    w1, w2 = _weights(2)
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)

    def fn(rows, _start, _stop):
        return torch.tanh(rows @ w1) @ w2

    assert isinstance(run_chunked(fn, x, [w1, w2], chunk_bounds(ROWS, 3), "cat"), torch.Tensor)
    with torch.no_grad():
        assert isinstance(run_chunked(fn, x, [w1, w2], chunk_bounds(ROWS, 3), "cat"), torch.Tensor)
