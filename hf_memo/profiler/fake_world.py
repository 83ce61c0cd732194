"""A fake process group, so that one rank of a sequence-parallel step can be profiled in a single process.

PyTorch's fake backend answers every collective at once without moving data, and the fake tensors keep the shapes
each rank would see: the profile is rank 0's real code path (hf_memo's sequence sharding and Ulysses exchanges,
their send and receive buffers included) with no other rank running.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_world(size: int) -> Iterator[None]:
    """Rank 0 of a default process group of ``size`` fake ranks, for the duration (nothing for ``size == 1``).

    Raises ``RuntimeError`` if this process already has a default process group (a profile cannot borrow a real
    job's ranks): profile in a process of its own.
    """
    if size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError(
            f"profiling one rank of {size} sequence-parallel ranks needs a fake process group, but this process "
            "already has a process group: estimate in a process without one (e.g. the hf-memo command line)"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()
