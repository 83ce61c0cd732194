import torch

from hf_memo.profiler.allocations import AllocationRecorder
from hf_memo.profiler.analysis import unfreed
from hf_memo.profiler.kernel_workspace import CUDA, PROFILED_TARGET, workspace_hook
from hf_memo.profiler.placement import mark_host, mark_owned, mark_part


def _recorder(phase="layer 0 forward", stage="forward"):
    return AllocationRecorder(lambda: phase, lambda: stage)


def _ops(trace):
    return [(e.op, e.tensor_id, e.size) for e in trace.events]


def test_new_storages_are_mallocs_and_their_death_the_matching_free():
    recorder = _recorder()
    with recorder:
        a = torch.ones(16)  # 64 bytes
        b = a * 2
        del a
        c = b + 1
        del b, c
    assert _ops(recorder.trace()) == [
        ("malloc", 0, 64),
        ("malloc", 1, 64),
        ("free", 0, 64),
        ("malloc", 2, 64),
        ("free", 1, 64),
        ("free", 2, 64),
    ]


def test_views_and_in_place_ops_add_no_events():
    recorder = _recorder()
    with recorder:
        a = torch.zeros(4, 8)
        view = a[1:].t()
        view.mul_(3)
        a.add_(1)
        a.view(32).fill_(2)
        del view
    trace = recorder.trace()
    assert _ops(trace) == [("malloc", 0, 128)]
    assert trace.meta["live_at_end"] == [0] == unfreed(trace)
    del a


def test_resizing_a_storage_is_a_free_of_the_old_size_and_a_malloc_of_the_new():
    recorder = _recorder()
    with recorder:
        a = torch.zeros(8)  # 32 bytes
        a.untyped_storage().resize_(64)
        a.resize_(32)  # aten.resize_: 128 bytes
        a.untyped_storage().resize_(0)  # released, as FSDP does with its buffers
        a.untyped_storage().resize_(16)
        empty = torch.empty(0)
    assert _ops(recorder.trace()) == [
        ("malloc", 0, 32),
        ("free", 0, 32),
        ("malloc", 1, 64),
        ("free", 1, 64),
        ("malloc", 2, 128),
        ("free", 2, 128),
        ("malloc", 3, 16),
    ]
    del a, empty


def test_placement_tags_set_after_allocation_reach_both_events():
    recorder = _recorder()
    with recorder:
        host = mark_host(torch.empty(10))
        owned = mark_owned(torch.empty(6), "rounding buffer 0")
        plain = torch.empty(2)
        del host, owned, plain
    events = recorder.trace().events
    assert [(e.op, e.location, e.name) for e in events] == [
        ("malloc", "host", None),
        ("malloc", "device", "rounding buffer 0"),
        ("malloc", "device", None),
        ("free", "host", None),
        ("free", "device", "rounding buffer 0"),
        ("free", "device", None),
    ]


def test_categories_are_decided_after_the_run():
    stage = {"now": "forward", "phase": "layer 0 forward"}
    recorder = AllocationRecorder(lambda: stage["phase"], lambda: stage["now"])
    weight = torch.ones(4)
    with recorder:
        recorder.track(weight, "parameter")
        saved = weight * 2  # kept into backward: activation
        scratch = weight + 1  # dies in its own phase: temporary
        del scratch
        stage.update(now="backward", phase="layer 0 backward")
        grad = saved * 3  # made in backward: temporary, until labelled
        recorder.label(grad, "gradient")
        del saved
    categories = {e.tensor_id: e.category for e in recorder.trace().events}
    assert categories == {0: "parameter", 1: "activation", 2: "temporary", 3: "gradient"}
    del grad


def test_real_storages_are_tagged_with_their_address():
    recorder = _recorder()
    with recorder:
        a = torch.empty(3)
    (tag,) = recorder.storage_tags()
    assert (tag.address, tag.size) == (a.untyped_storage().data_ptr(), 12)
    assert (tag.phase, tag.category, tag.location) == ("layer 0 forward", "activation", "device")


def test_recording_restores_storage_resize_and_the_collector():
    import gc

    original = torch.UntypedStorage.resize_
    enabled = gc.isenabled()
    with _recorder():
        assert torch.UntypedStorage.resize_ is not original
        assert not gc.isenabled()
    assert torch.UntypedStorage.resize_ is original
    assert gc.isenabled() == enabled


def test_a_recorder_modelling_a_cuda_targets_workspace_names_that_target_while_it_records():
    """The attention core reads it to run, on fake tensors, the kernel the target would (a window or soft-cap)."""
    for kernels, named in (("cuda", CUDA), ("cpu", None)):
        with AllocationRecorder(lambda: "other", lambda: "other", workspace_hook(kernels)):
            assert PROFILED_TARGET.get() is named
        assert PROFILED_TARGET.get() is None


def test_outputs_within_a_marked_part_are_numbered_by_op_and_the_numbers_restart_with_each_part():
    phase = ["layer 0 backward"]
    recorder = AllocationRecorder(lambda: phase[0], lambda: "backward")
    with recorder:
        a = torch.ones(4)
        keep = [a + 1]
        for kind in ("kept chunk", "recomputed chunk"):
            mark_part(kind)
            keep += [a * 2, a * 3, a * 5]  # the same op (after the same op) twice: two places of the part
        phase[0] = "layer 1 backward"  # a part ends with its phase
        keep.append(a * 4)
    sources = [e.source for e in recorder.trace().events if e.op == "malloc"][1:]
    assert sources == [
        "aten.ones.default > aten.add.Tensor",
        "aten.add.Tensor > aten.mul.Tensor @ kept chunk #0",
        "aten.mul.Tensor > aten.mul.Tensor @ kept chunk #0",
        "aten.mul.Tensor > aten.mul.Tensor @ kept chunk #1",
        "aten.mul.Tensor > aten.mul.Tensor @ recomputed chunk #0",
        "aten.mul.Tensor > aten.mul.Tensor @ recomputed chunk #1",
        "aten.mul.Tensor > aten.mul.Tensor @ recomputed chunk #2",
        "aten.mul.Tensor > aten.mul.Tensor",
    ]
