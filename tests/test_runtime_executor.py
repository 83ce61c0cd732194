"""The memo layer function against plain autograd on a small pure-torch layer."""

import gc
import math
import weakref
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from hf_memo.config import MemoConfig
from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.runtime.attention_core import LocalAttention, expand_kv
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.executor import MemoLayerFunction, project_rows
from hf_memo.runtime.memo import MemoRuntime
from hf_memo.runtime.stash import LayerStash
from tests.stash_recording import RecordingSource, attention_output_copies

pytestmark = pytest.mark.usefixtures("deferred_copies")  # copies carried out late, as CUDA may

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, WIDTH = 4, 2, 3, 12, 20


class ToySplit:
    """Norm -> q/k/v with a position-dependent scale | o-proj, residual, MLP with dropout, residual."""

    def __init__(self, params, positions, dropout=0.0):
        self.norm, self.wq, self.wk, self.wv, self.wo, self.w1, self.w2 = params
        self.positions, self.dropout = positions, dropout
        self.scale = HEAD_DIM**-0.5
        self.dropout_p = 0.0  # attention dropout

    @property
    def traits(self):
        return AttentionTraits(self.scale, self.dropout_p)

    def project(self, x, start, stop):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        b, s = x.shape[:2]
        heads = lambda w, n: (h @ w).view(b, s, n, HEAD_DIM).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.wq, HEADS), heads(self.wk, KV_HEADS), heads(self.wv, KV_HEADS)
        pos = self.positions[start:stop, None]
        return q * pos, k * pos, v

    def finish(self, x, o, start):
        h = x + project_rows(lambda rows: rows @ self.wo, o)
        return h + F.dropout(F.gelu(h @ self.w1), self.dropout, training=True) @ self.w2

    def kept(self):
        return [*self.params(), self.positions]

    def params(self):
        return [self.norm, self.wq, self.wk, self.wv, self.wo, self.w1, self.w2]


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (HIDDEN,),
        (HIDDEN, HEADS * HEAD_DIM),
        (HIDDEN, KV_HEADS * HEAD_DIM),
        (HIDDEN, KV_HEADS * HEAD_DIM),
        (HEADS * HEAD_DIM, HIDDEN),
        (HIDDEN, WIDTH),
        (WIDTH, HIDDEN),
    ]
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * 0.3).requires_grad_(True) for s in shapes]


def _reference(split, x):
    q, k, v = split.project(x, 0, x.shape[1])
    groups = HEADS // KV_HEADS
    o = F.scaled_dot_product_attention(q, expand_kv(k, groups), expand_kv(v, groups), is_causal=True, scale=split.scale)
    return split.finish(x, o.transpose(1, 2).reshape(*x.shape[:2], -1), 0)


def _run(fn, x, params, upstream):
    for p in params:
        p.grad = None
    x = x.detach().requires_grad_(True)
    y = fn(x)
    y.backward(upstream)
    return y.detach(), [x.grad, *[p.grad for p in params]]


def _memo(split, index, chunks, alpha_chunks, num_layers=3, keep_attention=True):
    """Layer ``index`` of a runtime whose layer 0 is on the host, the others on the device; every layer keeps
    its attention output, or (``keep_attention=False``) its input only."""
    runtime = MemoRuntime(MemoConfig(recompute="memo"), num_layers)
    runtime.assume_policy(MemoryPolicy(tuple(LayerPolicy(keep_attention, i == 0) for i in range(num_layers))))
    x = torch.zeros(1, 1, HIDDEN, dtype=torch.float64)
    runtime.alpha_chunks(split, x, [(0, 1)], LocalAttention, 0)

    def fn(x):
        return MemoLayerFunction.apply(
            runtime, split, LocalAttention, index, chunk_bounds(x.shape[1], chunks), alpha_chunks, x, *split.params()
        )

    return fn, runtime


@pytest.mark.parametrize("seq,chunks", [(13, 4), (16, 8), (7, 1)])
@pytest.mark.parametrize("alpha_chunks", ["none", "half", "all"])
@pytest.mark.parametrize("index", [0, 2], ids=["swapped-layer", "device-layer"])
@pytest.mark.parametrize("keep_attention", [True, False], ids=["X+attn", "X-only"])
def test_output_and_every_gradient_equal_plain_autograd(seq, chunks, alpha_chunks, index, keep_attention):
    params = _params()
    split = ToySplit(params, torch.linspace(0.5, 1.5, seq, dtype=torch.float64))
    offloaded = {"none": 0, "half": chunks // 2, "all": chunks}[alpha_chunks]
    x = torch.randn(2, seq, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(2, seq, HIDDEN, dtype=torch.float64)
    want_y, want_grads = _run(lambda t: _reference(split, t), x, params, upstream)
    fn, runtime = _memo(split, index, chunks, offloaded, keep_attention=keep_attention)
    host_before = runtime.host_reserved_bytes  # what calibrating the offload plan left in the pool
    got_y, got_grads = _run(fn, x, params, upstream)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert runtime.attention_calls == (1 if keep_attention else 2)  # X only: attention again in backward
    assert (runtime.host_reserved_bytes > host_before) == (index == 0)


def test_recomputed_chunks_replay_their_dropout_masks():
    params = _params()
    split = ToySplit(params, torch.ones(12, dtype=torch.float64), dropout=0.5)
    x = torch.randn(2, 12, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(2, 12, HIDDEN, dtype=torch.float64)
    results = []
    for offloaded in (4, 0):  # graph kept in forward vs recomputed in backward: same masks, same gradients
        torch.manual_seed(7)
        results.append(_run(_memo(split, 0, 4, offloaded)[0], x, params, upstream))
    (y_kept, grads_kept), (y_recomputed, grads_recomputed) = results
    assert torch.equal(y_kept, y_recomputed)
    for got, want in zip(grads_recomputed, grads_kept):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunks,offloaded", [(4, 0), (4, 2), (3, 3)])
def test_input_only_replays_the_attention_dropout_mask(chunks, offloaded):
    params = _params()
    split = ToySplit(params, torch.ones(12, dtype=torch.float64), dropout=0.5)
    split.dropout_p = 0.3  # the CPU dropout core: its mask seed is drawn from the CPU generator
    x = torch.randn(2, 12, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(2, 12, HIDDEN, dtype=torch.float64)
    results = []
    for keep_attention in (True, False):  # attention kept vs recomputed in backward: same masks, same gradients
        torch.manual_seed(7)
        fn, runtime = _memo(split, 0, chunks, offloaded, keep_attention=keep_attention)
        results.append(_run(fn, x, params, upstream))
        assert runtime.attention_calls == (1 if keep_attention else 2)
        torch.manual_seed(7)
        assert not torch.equal(_run(fn, x, params, upstream)[0], _run(fn, x, params, upstream)[0])  # masks differ
    (y_kept, grads_kept), (y_recomputed, grads_recomputed) = results
    assert torch.equal(y_recomputed, y_kept)
    for got, want in zip(grads_recomputed, grads_kept):
        assert torch.equal(got, want)


@pytest.mark.parametrize("offloaded", [0, 2, 4])
def test_input_only_stashes_no_attention_output(monkeypatch, offloaded):
    params = _params()
    split = ToySplit(params, torch.ones(16, dtype=torch.float64))
    x = torch.randn(2, 16, HIDDEN, dtype=torch.float64, requires_grad=True)
    sealed = {}
    monkeypatch.setattr(MemoRuntime, "sealed", lambda self, index, stash: sealed.setdefault(self, stash.raw_nbytes))
    for keep_attention in (True, False):
        fn, runtime = _memo(split, 2, 4, offloaded, keep_attention=keep_attention)
        fn(x).sum().backward()
        sealed[keep_attention] = sealed.pop(runtime)
    attention_output = x.shape[0] * x.shape[1] * HEADS * (HEAD_DIM + 1) * 8  # and its statistics
    # o_proj's input rows of the offloaded chunks are views of the attention output recomputed in backward.
    assert sealed[False] == sealed[True] - attention_output
    if offloaded == 0:
        assert sealed[False] == x.numel() * 8  # the layer input only


@pytest.mark.parametrize("index,freed", [(0, True), (2, False)], ids=["swapped-layer", "device-layer"])
def test_swapped_layer_holds_no_device_copy_of_its_input(index, freed):
    params = _params()
    split = ToySplit(params, torch.ones(16, dtype=torch.float64))
    fn, runtime = _memo(split, index, 4, 2)
    x0 = torch.randn(2, 16, HIDDEN, dtype=torch.float64, requires_grad=True)
    x = x0 * 1.0
    storage = weakref.ref(x.untyped_storage())
    y = fn(x)
    del x
    gc.collect()
    assert storage() is not None  # a swapped layer's stash holds it while its copy to the host may run
    runtime.open_stash(1, x0.device).seal()  # the next layer seals: that copy is waited on
    gc.collect()
    assert (storage() is None) == freed
    y.sum().backward()
    assert x0.grad is not None and torch.isfinite(x0.grad).all()


@pytest.mark.parametrize("chunks", [1, 3])
def test_offloading_every_token_stashes_one_copy_of_the_attention_output(chunks):
    """alpha = 1: the layer keeps its attention output once (the kernel's output, laid out (B, S, h, D) so that
    the rows o-proj reads are views of it), not the output plus a (B, S, h * D) copy; gradients stay exact."""
    params = _params()
    split = ToySplit(params, torch.linspace(0.5, 1.5, 10, dtype=torch.float64))
    x = torch.randn(2, 10, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(2, 10, HIDDEN, dtype=torch.float64)
    want_y, want_grads = _run(lambda t: _reference(split, t), x, params, upstream)
    source = RecordingSource()

    def fn(t):
        return MemoLayerFunction.apply(source, split, LocalAttention, 2, chunk_bounds(10, chunks), chunks, t, *params)

    got_y, got_grads = _run(fn, x, params, upstream)
    with torch.no_grad():
        q, k, v = split.project(x, 0, 10)
        out = F.scaled_dot_product_attention(q, expand_kv(k, 2), expand_kv(v, 2), is_causal=True, scale=split.scale)
    assert attention_output_copies(source.stash, out) == 1
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class TraitsSplit(ToySplit):
    """A layer whose attention has a sliding window, soft-capped scores and sinks, a parameter of the layer."""

    def __init__(self, params, positions, sinks):
        super().__init__(params, positions)
        self.sinks = sinks

    @property
    def traits(self):
        return AttentionTraits(self.scale, window=4, softcap=2.0, sinks=self.sinks)

    def params(self):
        return [*super().params(), self.sinks]


def _traits_reference(split, x):
    """The layer with its attention written out: capped scores, the window, the sink in the softmax."""
    q, k, v = split.project(x, 0, x.shape[1])
    scores = q @ expand_kv(k, HEADS // KV_HEADS).transpose(-1, -2) * split.scale
    scores = 2.0 * torch.tanh(scores / 2.0)
    i, j = torch.arange(x.shape[1])[:, None], torch.arange(x.shape[1])
    scores = scores.masked_fill((j > i) | (j <= i - 4), -torch.inf)
    sinks = split.sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sinks], -1).softmax(-1)[..., :-1]
    o = probs @ expand_kv(v, HEADS // KV_HEADS)
    return split.finish(x, o.transpose(1, 2).reshape(*x.shape[:2], -1), 0)


@pytest.mark.parametrize("alpha_chunks", [0, 3])
@pytest.mark.parametrize("keep_attention", [True, False], ids=["X+attn", "X-only"])
def test_attention_traits_reach_the_core_and_the_sinks_get_their_gradient(alpha_chunks, keep_attention):
    """The split's traits go to the core in forward, in an input-only layer's recomputation and in backward; the
    core's dsinks is added to the gradient of the parameter the sinks are."""
    params = [*_params(), torch.randn(HEADS, dtype=torch.float64, requires_grad=True)]
    split = TraitsSplit(params[:-1], torch.linspace(0.5, 1.5, 11, dtype=torch.float64), params[-1])
    x = torch.randn(2, 11, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(2, 11, HIDDEN, dtype=torch.float64)
    want_y, want_grads = _run(lambda t: _traits_reference(split, t), x, params, upstream)
    fn, _ = _memo(split, 0, 3, alpha_chunks, keep_attention=keep_attention)
    got_y, got_grads = _run(fn, x, params, upstream)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class _CopiedSinks(TraitsSplit):
    """The attention call gets a copy of the sinks parameter, not the parameter itself."""

    def __init__(self, params, positions, sinks):
        super().__init__(params, positions, sinks)
        self.copy = sinks * 1.0

    @property
    def traits(self):
        return AttentionTraits(self.scale, window=4, softcap=2.0, sinks=self.copy)


@pytest.mark.parametrize("trained", [True, False])
def test_sinks_that_need_a_gradient_but_are_no_parameter_of_the_layer_are_refused(trained):
    """A copy of the sinks parameter would lose its gradient: refused; a copy of frozen sinks needs none."""
    sinks = torch.randn(HEADS, dtype=torch.float64, requires_grad=trained)
    params = [*_params(), sinks]
    fn, _ = _memo(_CopiedSinks(params[:-1], torch.ones(6, dtype=torch.float64), sinks), 0, 2, 1)
    x, upstream = (torch.randn(1, 6, HIDDEN, dtype=torch.float64) for _ in "xy")
    if trained:
        with pytest.raises(RuntimeError, match="sinks need a gradient but are none of its parameters"):
            _run(fn, x, params, upstream)
    else:
        _run(fn, x, params[:-1], upstream)


class _Copy(torch.autograd.Function):
    """``x.clone()`` that records where its output lives and where the gradient it receives lives."""

    addresses = {}

    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        _Copy.addresses["output"] = out.data_ptr()
        return out

    @staticmethod
    def backward(ctx, grad):
        _Copy.addresses["grad"] = grad.data_ptr()
        return grad


@pytest.mark.parametrize("index", [0, 2], ids=["swapped-layer", "device-layer"])
@pytest.mark.parametrize("held", [False, True])
def test_the_input_gradient_takes_the_inputs_memory_only_where_nothing_else_reads_it(index, held):
    params = _params()
    split = ToySplit(params, torch.linspace(0.5, 1.5, 13, dtype=torch.float64))
    x = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    want_y, want_grads = _run(lambda t: _reference(split, t), x, params, upstream)
    fn, _ = _memo(split, index, 4, 1, keep_attention=False)
    kept = []

    def layer(t):
        copy = _Copy.apply(t)
        if held:
            kept.append(copy)  # e.g. a hidden state returned with output_hidden_states=True
        return fn(copy)

    got_y, got_grads = _run(layer, x, params, upstream)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if held:
        assert torch.equal(kept[0], x)  # the caller's tensor keeps its values
    # A device layer's input is the caller's tensor, taken only when the caller let go of it. (A swapped layer's
    # input comes back in a buffer of its own, which the gradient takes; the caller's tensor was freed after its
    # copy to the host, so that buffer may sit at the same address: no address tells the two apart there.)
    if index == 2:
        assert (_Copy.addresses["grad"] == _Copy.addresses["output"]) == (not held)


def _view_fetches(monkeypatch):
    """Every fetch of a view of a storage read in views (a chunk's attention-output rows, or a view inside them),
    as ``(ref, bytes copied to the device for it)``, in order."""
    fetches = []
    fetch_view = LayerStash.fetch_view

    def counting(stash, ref):
        copied, engine = [], stash._engine
        to_device = engine.to_device
        engine.to_device = lambda dst, src, after=None: copied.append(dst.nbytes) or to_device(dst, src, after)
        try:
            fetch_view(stash, ref)
        finally:
            del engine.to_device
        if copied:
            fetches.append((ref, sum(copied)))

    monkeypatch.setattr(LayerStash, "fetch_view", counting)
    return fetches


def _exact_with_view_fetches(monkeypatch, batch: int, seq: int, chunks: int, kept: int) -> list:
    """Layer 0 on the host with ``kept`` chunks' finish graphs kept in forward, run against the reference (loss and
    gradients exact); the views it fetched from the host, with their bytes."""
    params = _params()
    split = ToySplit(params, torch.linspace(0.5, 1.5, seq, dtype=torch.float64))
    x = torch.randn(batch, seq, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(batch, seq, HIDDEN, dtype=torch.float64)
    want_y, want_grads = _run(lambda t: _reference(split, t), x, params, upstream)
    fetches = _view_fetches(monkeypatch)
    fn, _ = _memo(split, 0, chunks, kept)
    got_y, got_grads = _run(fn, x, params, upstream)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    return fetches


@pytest.mark.parametrize("batch", [1, 2])
def test_a_chunk_of_the_kept_attention_output_comes_from_the_host_with_its_own_bytes_only(monkeypatch, batch):
    """A chunk's rows ``(B, h, rows, D)`` of the ``(B, S, h, D)`` attention output are ``B`` runs of host memory: the
    fetch copies those (one copy per sequence), not the span from the first sequence's rows to the last's, which
    for ``B = 2`` is ``S + rows`` rows of every head; gradients stay exact."""
    seq, chunks = 16, 4
    fetches = _exact_with_view_fetches(monkeypatch, batch, seq, chunks, kept=2)  # every chunk's rows fetched
    rows = seq // chunks
    chunk_rows = [nbytes for ref, nbytes in fetches if ref.shape == (batch, HEADS, rows, HEAD_DIM)]
    assert chunk_rows == [batch * HEADS * rows * HEAD_DIM * 8] * chunks
    assert all(nbytes == math.prod(ref.shape) * ref.dtype.itemsize for ref, nbytes in fetches)


@pytest.mark.parametrize("batch", [1, 2])
def test_each_kept_chunk_fetches_its_attention_output_rows_once(monkeypatch, batch):
    """A chunk whose finish graph was kept in forward reads its attention-output rows twice in backward: for the
    attention backward, and as the rows ``(s, h * D)`` of each sequence its o-projection saved. Both come from one
    fetch (the chunk's rows held on the device while its graph runs), not one more synchronous fetch per sequence."""
    seq, chunks = 16, 4
    fetches = _exact_with_view_fetches(monkeypatch, batch, seq, chunks, kept=chunks)  # finish graphs kept
    first_rows = Counter(ref.offset // (HEADS * HEAD_DIM) % seq for ref, _ in fetches)
    assert first_rows == {start: 1 for start, _ in chunk_bounds(seq, chunks)}
