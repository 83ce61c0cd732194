"""The self-check on parameters FSDP2 or DeepSpeed ZeRO-3 shard (see :mod:`hf_memo.patches.self_check`).

The probe runs inside the step's own forward, with the parameters the sharding gathers anyway: each layer's when
its hooks gather them, the root shard group's (embeddings, final norm, head) as gathered for the step. Every rank
probes its own rows, and every rank must make the same calls (each gather is a collective), so every decision the
check takes (whether to probe, whether a pass failed) is agreed over the ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


def sharded(model: nn.Module) -> bool:
    """Whether FSDP2 (DTensor parameters) or DeepSpeed ZeRO-3 (partitioned parameters) shards ``model``."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in model.parameters())


def any_rank(model: nn.Module, flag: bool) -> bool:
    """``flag`` on any rank of the default process group (``flag`` itself where ``model`` is not sharded)."""
    if not (dist.is_available() and dist.is_initialized() and sharded(model)):
        return flag
    parameter = next(model.parameters())
    device = parameter.device if dist.get_backend() != "gloo" else torch.device("cpu")
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def all_ranks(model: nn.Module, flag: bool) -> bool:
    """``flag`` on every rank of the default process group (``flag`` itself where ``model`` is not sharded)."""
    return not any_rank(model, not flag)


def gather_root(model: nn.Module) -> None:
    """Under FSDP2, the parameters of ``model``'s own shard group gathered, as its hooks gather them for the step's
    forward that the probe runs inside (a backward, the probe's, leaves them sharded)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.unshard()


@contextlib.contextmanager
def gathered(owner: nn.Module, module: nn.Module) -> Iterator[None]:
    """Inside, ``module``'s parameters whole, outside any forward of ``owner`` (the decoder layer holding it, which
    FSDP2 shards as one group): FSDP2 gathers ``owner``'s group, ZeRO-3 ``module``'s parameters; a collective."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(owner, FSDPModule):
        owner.unshard()
        try:
            yield
        finally:
            owner.reshard()
    elif any(hasattr(p, "ds_id") for p in module.parameters()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            yield
    else:
        yield
