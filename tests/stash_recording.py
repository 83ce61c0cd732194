"""A stash source that records what a memo layer stashes, and a count of stashed attention-output copies."""

import torch

from hf_memo.runtime.offload import CopyEngine, HostPool
from hf_memo.runtime.stash import DeviceSlots, LayerStash


class RecordingStash(LayerStash):
    """An unswapped stash that also keeps, per distinct storage, a flat copy of it (for inspection)."""

    def __init__(self):
        engine = CopyEngine(torch.device("cpu"))
        pool, slots = HostPool(torch.device("cpu")), DeviceSlots("test", torch.device("cpu"), engine)
        super().__init__(2, False, engine, pool, slots)
        self.storages = {}

    def add(self, tensor, read_in_views=False):
        storage = tensor.untyped_storage()
        whole = torch.as_strided(tensor.detach(), (storage.nbytes() // tensor.element_size(),), (1,), 0)
        self.storages.setdefault(storage.data_ptr(), whole.clone())
        return super().add(tensor, read_in_views)


class RecordingSource:
    """A stash source handing every layer the same :class:`RecordingStash`."""

    def __init__(self):
        self.stash = RecordingStash()

    def open_stash(self, index, device):
        return self.stash

    def sealed(self, index, stash):
        pass

    def fetch_below(self, stash, nbytes):
        pass

    def backward_done(self, stash, device):
        pass

    def attention_ran(self):
        pass


def attention_output_copies(stash, out):
    """How many stashed storages hold the whole attention output ``(B, h, S, D)`` or the rows of a chunk, in any
    layout (``(B, h, S, D)`` or ``(B, S, h * D)`` memory order)."""
    rows = out.transpose(1, 2).reshape(*out.shape[:1], out.shape[2], -1)
    layouts = [out.contiguous(), rows.contiguous()]
    chunk_rows = [rows[:, start:stop] for start in range(rows.shape[1]) for stop in range(start + 1, rows.shape[1] + 1)]
    candidates = [c.reshape(-1) for c in (*layouts, *chunk_rows)]
    return sum(
        any(data.shape == c.shape and data.dtype == c.dtype and torch.allclose(data, c, atol=1e-12) for c in candidates)
        for data in stash.storages.values()
    )
