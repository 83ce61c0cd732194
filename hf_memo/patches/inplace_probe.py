"""Whether a layer writes in place into the output of an op that selective recompute would keep.

Selective activation checkpointing caches the outputs it keeps by reference. A layer that then modifies
one in place (OLMoE's ``clip_qkv`` clamps its q/k/v projections with ``clamp_``) changes the cached value:
the recomputation reads the modified tensor and the backward of the in-place op sees no clipped entries,
so the gradient is wrong, silently where the write goes through an ``_unsafe_view`` that PyTorch's
mutation check does not follow. The probe runs the layers once on a few tokens, when hf_memo is applied, and
watches for such writes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hf_memo.patches.head_transform import holds_values
from hf_memo.patches.layer_split import eval_mode


def _storages(value: Any) -> list[StorageWeakRef]:
    return [StorageWeakRef(t.untyped_storage()) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _written(op: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments ``op`` writes into (in-place and ``out=`` variants)."""
    written = []
    for position, argument in enumerate(op._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(args[position] if position < len(args) else kwargs.get(argument.name))
    return written


class _WriteWatch(TorchDispatchMode):
    """Records the storages of ``kept`` ops' outputs and whether a later op writes into one of them."""

    def __init__(self, kept: Collection[Any]) -> None:
        super().__init__()
        self.kept, self.storages, self.written = kept, set(), False

    def __torch_dispatch__(self, op: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(ref in self.storages for ref in _storages(_written(op, args, kwargs))):
            self.written = True
        out = op(*args, **kwargs)
        if op in self.kept:
            self.storages.update(_storages(out))
        return out


def writes_into_kept_outputs(run: Callable[[], Any], kept: Collection[Any]) -> bool:
    """Whether ``run()`` (a layer's forward on a few rows, without gradient) writes in place into the output of an
    op in ``kept``."""
    watch = _WriteWatch(kept)
    with torch.no_grad(), watch:
        run()
    return watch.written


def layers_writing_into_kept_outputs(
    model: nn.Module, layers: list[nn.Module], kept: Collection[Any]
) -> dict[int, bool] | None:
    """For each of ``model``'s decoder ``layers`` (by index), whether it writes in place into a ``kept`` op's output,
    probed on a 4-token batch through the model's forward before any step (so nothing of it is traced by
    ``torch.compile`` later); ``None`` where the weights hold no values here (meta, fake, partitioned).
    """
    weight = model.get_input_embeddings().weight
    if not holds_values(weight):
        return None
    found: dict[int, bool] = {}

    def probe(index: int, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        found[index] = writes_into_kept_outputs(lambda: layer.forward(*args, **kwargs), kept)

    handles = [
        layer.register_forward_pre_hook(partial(lambda i, m, a, k: probe(i, m, a, k), index), with_kwargs=True)
        for index, layer in enumerate(layers)
    ]
    ids = torch.arange(4, device=weight.device)[None] % weight.shape[0]
    try:
        with torch.no_grad(), eval_mode(model):
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return found
