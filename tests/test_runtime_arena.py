import dataclasses
import warnings

import pytest
import torch

from hf_memo.planner.bilevel import plan_memory
from hf_memo.profiler.placement import owner_of
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace
from hf_memo.runtime.arena import Arena, ArenaWarning

ROWS, DIM, HIDDEN, CHUNKS = 24, 8, 20, 3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class RecordingBuffers:
    """Serves buffers by plain allocation and writes the malloc/free trace of the names taken."""

    def __init__(self) -> None:
        self.events: list[AllocationEvent] = []
        self.ids: dict[str, int] = {}

    def take(self, name: str, shape, dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self.ids[name] = len(self.events)
        self.events.append(AllocationEvent("malloc", self.ids[name], tensor.nbytes, name=name))
        return tensor

    def release(self, name: str) -> None:
        size = next(e.size for e in self.events if e.tensor_id == self.ids[name])
        self.events.append(AllocationEvent("free", self.ids[name], size))

    def trace(self) -> AllocationTrace:
        return AllocationTrace(self.events, {"rows": ROWS})


def inputs(device: str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, DIM, generator=gen, dtype=torch.float64), torch.randn(ROWS, DIM, generator=gen).double()
    w1, w2 = torch.randn(DIM, HIDDEN, generator=gen).double(), torch.randn(HIDDEN, DIM, generator=gen).double()
    return tuple(t.to(device) for t in (x, y, w1, w2))


def chunked_mlp_step(buffers, x, y, w1, w2):
    """Loss ``mean((relu(x w1) w2 - y)^2)`` and its gradients over row chunks, every intermediate a named buffer.

    ``x, y``: ``(ROWS, DIM)``; ``w1``: ``(DIM, HIDDEN)``; ``w2``: ``(HIDDEN, DIM)``.
    """
    loss = torch.zeros((), dtype=x.dtype, device=x.device)
    grad_w1, grad_w2 = torch.zeros_like(w1), torch.zeros_like(w2)
    for c, (xc, yc) in enumerate(zip(x.chunk(CHUNKS), y.chunk(CHUNKS))):
        n = len(xc)
        hidden = buffers.take(f"chunk {c} hidden", (n, HIDDEN), x.dtype)
        torch.matmul(xc, w1, out=hidden)
        act = buffers.take(f"chunk {c} act", (n, HIDDEN), x.dtype)
        torch.clamp(hidden, min=0, out=act)
        out = buffers.take(f"chunk {c} out", (n, DIM), x.dtype)
        torch.matmul(act, w2, out=out)
        out.sub_(yc)
        loss += out.pow(2).sum() / out.new_tensor(ROWS * DIM)
        out.mul_(2.0 / (ROWS * DIM))  # now d loss / d out
        grad_w2 += act.T @ out
        buffers.release(f"chunk {c} act")
        grad_act = buffers.take(f"chunk {c} grad act", (n, HIDDEN), x.dtype)
        torch.matmul(out, w2.T, out=grad_act)
        buffers.release(f"chunk {c} out")
        grad_act.mul_(hidden > 0)
        buffers.release(f"chunk {c} hidden")
        grad_w1 += xc.T @ grad_act
        buffers.release(f"chunk {c} grad act")
    return loss, grad_w1, grad_w2


@pytest.fixture(scope="module")
def planned():
    recorder = RecordingBuffers()
    chunked_mlp_step(recorder, *inputs())
    trace = recorder.trace()
    return trace, plan_memory(trace, progress=False)


@pytest.mark.parametrize("device", DEVICES)
def test_a_computation_through_the_arena_equals_plain_allocations_and_autograd(planned, device):
    trace, plan = planned
    arena = Arena(plan, device)
    assert arena.planned and arena.buffer.numel() == plan.arena_size
    total = sum(e.size for e in trace.events if e.op == "malloc")
    assert plan.arena_size < total  # buffers really share memory
    with warnings.catch_warnings():
        warnings.simplefilter("error", ArenaWarning)  # every buffer must come from the plan
        with_arena = chunked_mlp_step(arena, *inputs(device))
    plain = chunked_mlp_step(Arena(None, device), *inputs(device))
    for a, b in zip(with_arena, plain):
        assert torch.equal(a, b)
    x, y, w1, w2 = inputs(device)
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    reference = ((x @ w1).relu() @ w2 - y).pow(2).mean()
    reference.backward()
    torch.testing.assert_close(with_arena[0], reference.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(with_arena[1], w1.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(with_arena[2], w2.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
def test_views_of_buffers_alive_together_never_overlap(planned, device):
    trace, plan = planned
    arena = Arena(plan, device)
    names = {e.tensor_id: e.name for e in trace.events if e.op == "malloc"}
    views, shared = {}, 0
    for number, event in enumerate(trace.events):
        name = names[event.tensor_id]
        if event.op == "malloc":
            view = arena.take(name, (event.size // 8,), torch.float64)
            assert view.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
            shared += any(v.data_ptr() == view.data_ptr() for v, _ in views.values())
            view.fill_(number)
            views[name] = (view, number)
        else:
            view, value = views.pop(name)
            assert torch.all(view == value), f"{name} was overwritten while alive"
            arena.release(name)
    assert shared == 0


def test_without_a_plan_buffers_are_normal_allocations_tagged_with_their_name():
    arena = Arena(None, "cpu")
    tensor = arena.take("layer 0 rounding 0", (4, 3), torch.bfloat16)
    assert not arena.planned and tensor.shape == (4, 3) and tensor.dtype == torch.bfloat16
    assert owner_of(tensor.untyped_storage()) == "layer 0 rounding 0"
    arena.release("layer 0 rounding 0")


def test_a_plan_whose_arena_is_not_used_serves_every_buffer_normally_without_warnings(planned):
    _, plan = planned
    unused = dataclasses.replace(plan, arena_used=False)  # the planner found the caching allocator better
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arena = Arena(unused, "cpu")
        tensor = arena.take("chunk 0 hidden", (8, HIDDEN), torch.float64)
    assert not arena.planned and arena.buffer.numel() == 0 and owner_of(tensor.untyped_storage()) == "chunk 0 hidden"


def test_requests_the_plan_cannot_serve_safely_fall_back_with_a_warning(planned):
    _, plan = planned
    arena = Arena(plan, "cpu")
    with pytest.warns(ArenaWarning, match="buffer 'mystery' is not in the memory plan; allocating it normally"):
        unknown = arena.take("mystery", (3,), torch.float32)
    assert unknown.untyped_storage().data_ptr() != arena.buffer.untyped_storage().data_ptr()
    with pytest.warns(ArenaWarning, match=r"buffer 'chunk 0 out' needs 1280 bytes, the plan has 512"):
        arena.take("chunk 0 out", (160,), torch.float64)
    smaller = arena.take("chunk 1 out", (10,), torch.float64)  # fits in its slot: served from the plan
    assert smaller.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
    with pytest.warns(ArenaWarning, match="'chunk 1 out' is taken again before it was released"):
        arena.take("chunk 1 out", (10,), torch.float64)


def test_a_buffer_overlapping_one_still_taken_is_not_served_from_the_plan(planned):
    _, plan = planned
    arena = Arena(plan, "cpu")
    first = next(n for n in plan.arena_offsets if n.startswith("chunk 0"))
    rival = next(
        n for n in plan.arena_offsets if n.startswith("chunk 2") and plan.arena_offsets[n] == plan.arena_offsets[first]
    )
    held = arena.take(first, (8,), torch.float64)
    held.fill_(7.0)
    with pytest.warns(ArenaWarning, match=f"buffer '{rival}' would overlap '{first}', which is still taken"):
        other = arena.take(rival, (8,), torch.float64)
    other.fill_(-1.0)
    assert torch.all(held == 7.0)


def test_a_plan_for_other_shapes_is_not_used_or_is_replaced(planned):
    trace, plan = planned
    with pytest.warns(ArenaWarning, match="the memory plan was made for trace .* buffers come from the caching"):
        arena = Arena(plan, "cpu", fingerprint="0123456789abcdef")
    assert not arena.planned and arena.buffer.numel() == 0
    assert Arena.for_trace(trace, "cpu", plan).plan is plan
    assert not Arena.for_trace(trace, "cpu", plan, solver="off").planned
    bigger = AllocationTrace([AllocationEvent(e.op, e.tensor_id, 2 * e.size, name=e.name) for e in trace.events])
    with pytest.warns(ArenaWarning, match="re-planning"):
        replanned = Arena.for_trace(bigger, "cpu", plan)
    assert replanned.planned and replanned.plan.fingerprint != plan.fingerprint
    assert replanned.buffer.numel() == replanned.plan.arena_size > plan.arena_size
