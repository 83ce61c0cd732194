import copy

import pytest
import torch

import hf_memo
from hf_memo.runtime.offload import CopyEngine, HostPool, copy_engine
from hf_memo.runtime.stash import ALIGN, CopiesInFlight, DeviceSlots, LayerStash
from tests.conftest import build_model, make_batch

pytestmark = pytest.mark.usefixtures("deferred_copies")  # copies carried out late, as CUDA may


def _stash(index=0, swapped=True):
    device = torch.device("cpu")
    engine = CopyEngine(device)
    pool = HostPool(device)
    return LayerStash(index, swapped, engine, pool, DeviceSlots("prefetch", device, engine)), pool


@pytest.mark.parametrize("swapped", [False, True])
def test_round_trip_rebuilds_views_with_their_shapes_and_strides(swapped):
    stash, pool = _stash(swapped=swapped)
    base = torch.randn(6, 10, dtype=torch.float64)
    other = torch.arange(7, dtype=torch.int32)
    views = [base, base[:, 2:5], base.t(), other[1:]]
    refs = [stash.add(v) for v in views]
    expected = [(v.clone(), v.stride()) for v in views]
    stash.seal()
    assert stash.nbytes == 2 * ALIGN  # two storages, each rounded up to the alignment
    if swapped:
        base.zero_()  # the device copy is no longer used
        assert pool.in_use_bytes == stash.nbytes
    for ref, (want, stride) in zip(refs, expected):
        got = stash.rebuild(ref)
        assert got.shape == want.shape and got.stride() == stride and torch.equal(got, want)
    stash.release()
    assert pool.in_use_bytes == 0


def test_each_storage_is_kept_once():
    stash, _ = _stash()
    x = torch.randn(4, 8)
    for rows in range(4):
        stash.add(x[rows])
    assert stash.raw_nbytes == x.numel() * 4


def test_a_prefetch_buffer_is_as_large_as_its_stash_and_goes_back_after_its_backward():
    device = torch.device("cpu")
    engine = CopyEngine(device)
    prefetch = DeviceSlots("prefetch", device, engine)
    pool = HostPool(device)
    stashes = []
    for index, numel in enumerate((100, 300, 200)):
        stash = LayerStash(index, True, engine, pool, prefetch)
        stash.add(torch.randn(numel))
        stash.seal()
        stashes.append(stash)
    top, middle, bottom = reversed(stashes)
    top.prefetch()
    middle.prefetch()  # fetched ahead while the top layer's backward runs
    assert prefetch.reserved_bytes == _aligned_bytes(200) + _aligned_bytes(300)
    top.release()
    assert prefetch.reserved_bytes == _aligned_bytes(300)  # only the layer running now and the one fetched ahead
    bottom.prefetch()
    middle.release()
    bottom.release()
    assert prefetch.reserved_bytes == 0


def _aligned_bytes(numel):
    return -(-numel * 4 // ALIGN) * ALIGN


def test_a_swapped_stash_copies_its_tensors_without_a_device_staging_buffer():
    """Sealing copies each storage straight into the host buffer: the only device bytes allocated are none."""
    from hf_memo.profiler.allocations import AllocationRecorder

    device = torch.device("cpu")
    engine = CopyEngine(device)
    stash = LayerStash(0, True, engine, HostPool(device), DeviceSlots("prefetch", device, engine))
    values = [torch.randn(6, 10), torch.arange(7, dtype=torch.int32)]
    refs = [stash.add(v) for v in values]
    with AllocationRecorder(lambda: "layer 0 forward", lambda: "forward") as recorder:
        stash.seal()
    events = recorder.trace().events
    assert [e.location for e in events if e.op == "malloc"] == ["host"]  # the host buffer, nothing on the device
    for ref, value in zip(refs, values):
        assert torch.equal(stash.rebuild(ref), value)


def test_a_stash_fetched_in_pieces_as_memory_frees_rebuilds_every_tensor_and_gives_the_pieces_back():
    """The layer above gives memory back chunk by chunk: the stash fetches that many of its bytes each time into a
    piece of its own (never more than asked), and its backward joins them into its prefetch buffers (the layer input
    in one, the rest in the other) and lets the pieces go."""
    from hf_memo.profiler.allocations import AllocationRecorder

    device = torch.device("cpu")
    engine = CopyEngine(device)
    prefetch = DeviceSlots("prefetch", device, engine)
    stash = LayerStash(1, True, engine, HostPool(device), prefetch)
    values = [torch.randn(3, 100, dtype=torch.float64), torch.randn(5, 40), torch.arange(300, dtype=torch.int32)]
    refs = [stash.add(v) for v in values]
    stash.seal()
    with AllocationRecorder(lambda: "layer 2 backward", lambda: "backward") as recorder:
        for given_back in (0, ALIGN + 7, 3 * ALIGN, 3 * ALIGN, stash.nbytes - 1, 10 * stash.nbytes):
            stash.prefetch(given_back)
    pieces = [e.size for e in recorder.trace().events if e.op == "malloc" and e.location == "device"]
    assert pieces == [ALIGN + 7, 2 * ALIGN - 7, stash.nbytes - 1 - 3 * ALIGN, 1]  # as many as given back, no more
    assert sum(pieces) == stash.nbytes and prefetch.reserved_bytes == 0
    with AllocationRecorder(lambda: "layer 1 backward", lambda: "backward") as recorder:
        for ref, value in zip(refs, values):
            assert torch.equal(stash.rebuild(ref), value)
    events = recorder.trace().events
    frees = [e.size for e in events if e.op == "free" and e.location == "device"]
    assert sorted(frees) == sorted(pieces)  # every piece goes back once its bytes are in the buffers
    assert prefetch.reserved_bytes == stash.nbytes
    stash.release()
    assert prefetch.reserved_bytes == 0


def test_planned_slots_fetch_a_stash_whole_at_the_first_call_and_read_no_storage_in_views():
    """With the memory planned, the profile that makes the plan and the steps its arena serves must fetch alike, as
    the arena's regions are laid out: the whole stash into its buffers as soon as the layer above's backward asks
    for any of it, the attention output with the rest."""
    device = torch.device("cpu")
    engine = CopyEngine(device)
    prefetch = DeviceSlots("prefetch", device, engine, planned=True)
    stash = LayerStash(1, True, engine, HostPool(device), prefetch)
    x, out = torch.randn(1000), torch.randn(2, 300)
    refs = [stash.add(x), stash.add(out, read_in_views=True)]
    stash.seal()
    stash.prefetch(0)
    assert stash._pieces == [] and prefetch.reserved_bytes == stash.nbytes
    assert torch.equal(stash.rebuild(refs[0]), x) and torch.equal(stash.rebuild(refs[1]), out)


@pytest.mark.parametrize("swapped", [False, True])
def test_a_storage_read_in_views_comes_one_view_at_a_time_and_not_with_the_prefetch_buffers(swapped):
    """The attention output of a layer whose backward reads it chunk by chunk: a swapped stash fetches each chunk's
    rows (ahead, or when rebuilt) into a tensor of their own, and its prefetch buffers hold only the rest."""
    device = torch.device("cpu")
    engine = CopyEngine(device)
    copies = []
    to_device = engine.to_device
    engine.to_device = lambda dst, src, after=None: copies.append(dst.numel()) or to_device(dst, src, after)
    prefetch = DeviceSlots("prefetch", device, engine)
    stash = LayerStash(1, swapped, engine, HostPool(device), prefetch)
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    out = torch.randn(1, 12, 4, 8, dtype=torch.float64).transpose(1, 2)  # (B, h, S, D) view of (B, S, h, D)
    lse = torch.randn(1, 4, 12)
    x_ref, out_ref, lse_ref = stash.add(x), stash.add(out, read_in_views=True), stash.add(lse)
    bounds = [(0, 5), (5, 9), (9, 12)]
    row_refs = [stash.add(out[:, :, start:stop]) for start, stop in bounds]
    want = [t.clone() for t in (x, out, lse)]
    stash.seal()
    assert torch.equal(stash.rebuild(x_ref), want[0]) and torch.equal(stash.rebuild(lse_ref), want[2])
    assert prefetch.reserved_bytes == (_aligned_bytes(12 * 16 * 2) + _aligned_bytes(4 * 12) if swapped else 0)
    stash.fetch_view(row_refs[2])  # ahead of its rebuild
    for ref, (start, stop) in reversed(list(zip(row_refs, bounds))):
        rows = stash.rebuild(ref)
        assert rows.shape == (1, 4, stop - start, 8) and torch.equal(rows, want[1][:, :, start:stop])
        if not swapped:
            assert rows.data_ptr() == out[:, :, start:stop].data_ptr()  # a view, no copy
    assert torch.equal(stash.rebuild(out_ref), want[1])  # whole, when asked for whole
    row = 4 * 8 * 8
    assert copies == (
        [_aligned_bytes(12 * 16 * 2), _aligned_bytes(4 * 12), 3 * row, 4 * row, 5 * row, 12 * row] if swapped else []
    )
    stash.release()


def _counting_stash() -> tuple[LayerStash, list[int]]:
    """A swapped CPU stash under this run's copy engine, and the bytes of each host-to-device copy it makes."""
    device = torch.device("cpu")
    engine = copy_engine(device)
    copies = []
    to_device = engine.to_device
    engine.to_device = lambda dst, src, after=None: copies.append(dst.nbytes) or to_device(dst, src, after)
    return LayerStash(1, True, engine, HostPool(device, copies=engine), DeviceSlots("prefetch", device, engine)), copies


def test_a_view_read_from_the_host_takes_its_own_bytes_only_one_copy_per_run():
    """Views of a ``(B, S, h, D)`` attention output read from the host one at a time: each fetch copies the view's
    own bytes, one copy per run of consecutive ones (a chunk's rows: one per sequence), never the span between
    its first and last byte, and rebuilds it with its values (copies carried out late under the deferred engine)."""
    stash, copies = _counting_stash()
    out = torch.randn(2, 12, 4, 8, dtype=torch.float64).transpose(1, 2)  # (B, h, S, D) view of (B, S, h, D)
    stash.add(torch.randn(2, 12, 16, dtype=torch.float64))  # the layer input, first: fetched with the buffers
    stash.add(out, read_in_views=True)
    views = [out[:, :, 0:5], out[:, :, 5:12], out[1, :, 3:7], out[:, 1:3, 2:5]]  # chunks, a sequence's, some heads
    refs = [stash.add(view) for view in views]
    want = [view.clone() for view in views]
    stash.seal()
    runs = [[5 * 4 * 8 * 8] * 2, [7 * 4 * 8 * 8] * 2, [4 * 4 * 8 * 8], [2 * 8 * 8] * 6]  # bytes of each copy
    stash.prefetch()
    for ref, value, copied in zip(refs, want, runs):
        copies.clear()
        rebuilt = stash.rebuild(ref)
        assert copies == copied and sum(copied) == value.numel() * 8
        assert rebuilt.shape == value.shape and torch.equal(rebuilt, value)
    stash.release()


def test_a_held_view_serves_the_views_inside_one_of_its_runs_until_dropped():
    """A chunk's rows held on the device (``hold_view``) serve the saved views that lie inside one of its runs (a
    sequence's rows of the chunk, as the o-projection saves them) without a copy; a view across two runs, or any
    view once the rows are dropped, is fetched. Values stay exact (copies carried out late under the deferred
    engine)."""
    stash, copies = _counting_stash()
    stash.add(torch.randn(2, 12, 16, dtype=torch.float64))
    out = torch.randn(2, 12, 4, 8, dtype=torch.float64).transpose(1, 2)  # (B, h, S, D) view of (B, S, h, D)
    stash.add(out, read_in_views=True)
    rows = out.transpose(1, 2).reshape(2, 12, 32)  # (B, S, h * D), a view
    chunk, inside, across = (stash.add(v) for v in (out[:, :, 4:8], rows[1, 5:8], rows[:, 5:7]))
    gapped, row = stash.add(out[1, 1:3, 5:8]), stash.add(out[1, 1:3, 6])  # two heads of three rows, and of one
    want = [v.clone() for v in (out[:, :, 4:8], rows[1, 5:8], rows[:, 5:7])]
    stash.seal()
    stash.prefetch()
    for ref, value, copied in ((chunk, want[0], 2), (inside, want[1], 0), (across, want[2], 2)):
        copies.clear()
        got = stash.hold_view(ref) if ref is chunk else stash.rebuild(ref)
        assert len(copies) == copied and torch.equal(got, value)
    stash.drop_view(chunk)
    copies.clear()
    assert torch.equal(stash.rebuild(inside), want[1]) and copies == [3 * 32 * 8]
    # holding a view with gaps inside a held chunk: fetched on its own, then it serves the views inside its runs
    stash.hold_view(chunk)
    copies.clear()
    assert torch.equal(stash.hold_view(gapped), want[0][1, 1:3, 1:4]) and copies == [2 * 8 * 8] * 3
    assert torch.equal(stash.rebuild(row), want[0][1, 1:3, 2]) and len(copies) == 3
    stash.release()


def test_a_sealed_stash_keeps_its_device_tensors_until_the_next_stash_of_the_device_seals():
    """A swapped stash's copies to the host may still run after its seal (CUDA's copy stream; the deferred engine
    here, which holds no device source): the stash keeps their device tensors until they are waited on, when the next
    stash sharing its :class:`CopiesInFlight` seals, or backward begins, so that one stash's memory in flight is
    held by tensors (and no source is freed with its copy pending: the fixture fails the test on that)."""
    import gc
    import weakref

    device = torch.device("cpu")
    engine = copy_engine(device)
    pool, slots, in_flight = HostPool(device, copies=engine), DeviceSlots("prefetch", device, engine), CopiesInFlight()
    stashes = [LayerStash(index, True, engine, pool, slots, in_flight=in_flight) for index in range(3)]
    values, kept = [torch.full((64,), float(index)) for index in range(3)], []
    for stash, value in zip(stashes, values):
        kept.append((weakref.ref(value.untyped_storage()), stash.add(value), value.clone()))
        stash.seal()
    del value, values
    gc.collect()
    assert [storage() is None for storage, _, _ in kept] == [True, True, False]  # the latest one only is in flight
    top = stashes[-1]
    assert torch.equal(top.rebuild(kept[-1][1]), kept[-1][2])  # backward begins: its copies are waited on
    gc.collect()
    assert kept[-1][0]() is None
    for stash, (_, ref, want) in zip(stashes, kept):
        assert torch.equal(stash.rebuild(ref), want)
        stash.release()


def test_a_slot_taken_by_another_stash_is_fetched_again_by_the_one_that_lost_it():
    """Two graphs' stashes of the same layer take turns in one prefetch slot: the holder that lost the slot
    must not read the other's bytes."""
    device = torch.device("cpu")
    engine = CopyEngine(device)
    prefetch = DeviceSlots("prefetch", device, engine)
    pool = HostPool(device)
    first, second = (LayerStash(2, True, engine, pool, prefetch) for _ in range(2))
    values = [torch.full((64,), 1.0), torch.full((64,), 2.0)]
    refs = [stash.add(v) for stash, v in zip((first, second), values)]
    for stash in (first, second):
        stash.seal()
    first.prefetch()
    assert torch.equal(first.rebuild(refs[0]), values[0])
    second.prefetch()  # same layer index, same slot: ``first`` is evicted
    assert torch.equal(second.rebuild(refs[1]), values[1])
    assert torch.equal(first.rebuild(refs[0]), values[0])  # fetched again, into the slot ``second`` lost
    assert torch.equal(second.rebuild(refs[1]), values[1])
    prefetch.release_all()  # the buffers go back: their holder fetches again when it is next rebuilt
    assert prefetch.reserved_bytes == 0 and torch.equal(second.rebuild(refs[1]), values[1])


def test_a_kept_stash_serves_another_backward_and_a_freed_one_says_so():
    stash, pool = _stash()
    value = torch.randn(40)
    ref = stash.add(value)
    stash.seal()
    for _ in range(2):  # retain_graph=True: the host copy stays, the device slot goes back
        assert torch.equal(stash.rebuild(ref), value)
        stash.release(keep=True)
        assert pool.in_use_bytes == stash.nbytes
    stash.release()
    assert pool.in_use_bytes == 0
    with pytest.raises(RuntimeError, match="layer 0's memo stash was freed by a backward through this graph"):
        stash.rebuild(ref)


def test_a_stash_dropped_without_backward_gives_its_host_buffer_back():
    import gc

    stash, pool = _stash()
    stash.add(torch.randn(300))
    stash.seal()
    assert pool.in_use_bytes == ALIGN * 3
    del stash
    gc.collect()
    assert pool.in_use_bytes == 0 and pool.reserved_bytes == ALIGN * 3


def _stashed_under_autocast(model, ids, labels):
    """Loss, and (shape, dtype) of every storage the memo stashes took, of a step under CPU bf16 autocast."""
    taken = []
    original = LayerStash.add

    def spy(self, tensor, read_in_views=False):
        if tensor.untyped_storage()._cdata not in self._index_of:
            taken.append((tensor.untyped_storage().nbytes() // tensor.element_size(), tensor.dtype))
        return original(self, tensor, read_in_views)

    LayerStash.add = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
    finally:
        LayerStash.add = original
    loss.backward()
    return loss.detach(), taken


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen-attention"])
def test_autocast_weight_casts_are_never_stashed_and_gradients_track_unpatched(frozen):
    model = build_model("llama", dtype=torch.float32, num_hidden_layers=4)
    if frozen:  # frozen fp32 weights: autocast's casts of them have no graph
        for name, p in model.named_parameters():
            p.requires_grad_("self_attn" not in name)
    reference = copy.deepcopy(model)
    hf_memo.apply(model, recompute="memo", offload_fraction=1.0, mlp_chunks=3, lm_head_chunks=2)
    ids, labels = make_batch(2, 20)
    got, taken = _stashed_under_autocast(model, ids, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    weight_sizes = {p.numel() for p in model.parameters()}
    assert taken and not [t for t in taken if t[0] in weight_sizes], "a weight's bf16 cast was stashed"
    torch.testing.assert_close(got, want.detach(), rtol=1e-2, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-2 * q.grad.abs().max().item(), msg=name)


def test_a_device_stash_owns_its_input_only_when_no_tensor_outside_references_it():
    stash, _ = _stash(swapped=False)
    x = torch.randn(4, 8)
    ref = stash.add(x)
    stash.seal()
    rebuilt = stash.rebuild(ref)
    assert not stash.owns(ref)  # the caller's ``x`` is still alive: its gradient must not be written over it
    del x
    assert stash.owns(ref)
    row = rebuilt[1]
    assert not stash.owns(ref) and stash.owns(ref, views=2)  # views of the caller's own count as its own
    del row


@pytest.mark.parametrize("arena", [False, True])
def test_a_fetched_stash_owns_its_input_buffer_unless_an_arena_serves_it(arena):
    device = torch.device("cpu")
    engine = CopyEngine(device)
    slots = DeviceSlots("prefetch", device, engine)
    if arena:
        slots.arena = _StubArena()
    stash = LayerStash(0, True, engine, HostPool(device), slots)
    x, saved = torch.randn(4, 8), torch.randn(100)
    ref, other = stash.add(x), stash.add(saved)
    stash.seal()
    rebuilt = stash.rebuild(ref)
    assert torch.equal(rebuilt, x) and torch.equal(stash.rebuild(other), saved)
    assert stash.owns(ref) is not arena and not stash.owns(other)  # the input's buffer is a part of its own
    stash.release()
    assert torch.equal(rebuilt, x)  # the input's memory outlives the slot (without an arena)


class _StubArena:
    """Hands out fresh buffers by name, as a planned arena's regions would be."""

    def take(self, name, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def release(self, name):
        pass


def test_a_tensor_on_another_device_than_the_stash_stays_out_of_it():
    """A host scalar saved inside a CUDA layer must not reach the copy stream (``record_stream`` refuses host
    tensors): tensors on another device than the stash's are saved as they are. The stash here is on the meta
    device; the saved tensors are on the CPU."""
    from hf_memo.runtime.stash import stash_hooks

    stash, _ = _stash()
    stash._engine = type("Engine", (), {"device": torch.device("meta")})()
    x = torch.randn(3, requires_grad=True)
    scale = torch.tensor(2.0, dtype=torch.float64)
    with stash_hooks(stash, [], stash_them=False):
        y = (x * scale).sum()
    assert stash.raw_nbytes == 0  # nothing stashed
    y.backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
