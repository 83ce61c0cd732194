"""Sequence-parallel process groups: the world split into data-parallel replicas of sequence-parallel groups.

Ranks ``[k * sp, (k + 1) * sp)`` form sequence-parallel group ``k`` (the sequence dimension is the
inner one, as in Accelerate's device mesh and DeepSpeed's groups); ranks with the same position in
their group form the data-parallel dimension. World size = data-parallel size x sequence-parallel size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's place in a (data-parallel x sequence-parallel) world.

    Attributes:
        group: the process group of this rank's sequence-parallel group (``sp_size`` ranks).
        sp_size: ranks one sequence is split over.
        sp_rank: this rank's index in its sequence-parallel group (which shard of the sequence it holds).
        dp_size: data-parallel replicas (``world_size // sp_size``): how many different batches a step sees.
        dp_rank: this rank's replica index (which batch it works on).
    """

    group: dist.ProcessGroup
    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int


# Degree -> (the default group they were built in, the groups); rebuilt when the default group changes.
_GROUPS: dict[int, tuple[dist.ProcessGroup, SequenceParallelGroups]] = {}


def _accepted_divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_not_accelerate_deepspeed_sp(size: int) -> None:
    """Refuse hf_memo's sequence parallelism when ``accelerate launch`` configured DeepSpeed's as well.

    Both would split the sequence: DeepSpeed's Ulysses (Accelerate's ``ParallelismConfig(sp_size=N,
    sp_backend="deepspeed")``) shards the batches and wraps attention itself; hf_memo then runs its
    mini-sequences on those shards with ``sequence_parallel_size=1``.
    """
    deepspeed_sp = int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1") or 1)
    if size > 1 and deepspeed_sp > 1 and os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed") == "deepspeed":
        raise ValueError(
            f"MemoConfig.sequence_parallel_size={size} but Accelerate is configured for DeepSpeed sequence "
            f"parallelism (sp_size={deepspeed_sp}), which already splits the sequence; use one: "
            "MemoConfig(sequence_parallel_size=1) with Accelerate's DeepSpeed Ulysses (hf_memo's mini-sequences "
            "then run on DeepSpeed's shards), or hf_memo's sequence parallelism without parallelism_config sp_size"
        )


def deepspeed_ulysses_attention() -> bool:
    """Whether DeepSpeed's Ulysses (``UlyssesSPAttentionHF.register_with_transformers``, what Accelerate's
    ``ParallelismConfig(sp_backend="deepspeed")`` calls) has replaced one of transformers' attention functions in
    this process, or ``accelerate launch`` configured it (``parallelism_config_sp_size > 1``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    launched_size = int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1") or 1)
    if launched_size > 1 and os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed") == "deepspeed":
        return True
    return any(
        getattr(ALL_ATTENTION_FUNCTIONS[name], "__module__", "").startswith("deepspeed.runtime.sequence_parallel")
        for name in ALL_ATTENTION_FUNCTIONS.valid_keys()
    )


def check_memo_not_under_deepspeed_ulysses() -> None:
    """Refuse ``recompute="memo"`` under DeepSpeed's Ulysses: the memo executor runs attention itself, so
    DeepSpeed's all-to-all would never see it and each rank would attend within its own shard only."""
    if deepspeed_ulysses_attention():
        raise ValueError(
            "MemoConfig.recompute='memo' computes attention itself, so DeepSpeed's Ulysses sequence parallelism "
            "(Accelerate's ParallelismConfig(sp_backend='deepspeed', sp_size=N)) would not exchange it and each rank "
            "would attend within its own shard. Use one: hf_memo's own sequence parallelism with the memo executor "
            "(hf_memo.apply(model, recompute='memo', sequence_parallel_size=N) and "
            "hf_memo.integrations.accelerate.attach, without parallelism_config sp_size), or keep DeepSpeed's with "
            "MemoConfig.recompute='none', 'full' or 'selective', whose attention calls go through DeepSpeed's"
        )


def sequence_parallel_groups(size: int) -> SequenceParallelGroups:
    """The sequence-parallel groups of degree ``size`` over the default process group (created once, cached).

    Creating them is collective: every rank must call this the first time (with the same ``size``).

    Raises:
        ValueError: no process group is initialized, or the world size is not a multiple of ``size``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"MemoConfig.sequence_parallel_size={size} needs torch.distributed, but no process group is "
            "initialized: launch with `accelerate launch` or `torchrun` and create the Accelerator (or the "
            "TrainingArguments) before training"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % size != 0:
        raise ValueError(
            f"MemoConfig.sequence_parallel_size={size} must divide the world size {world_size} "
            f"(world = data-parallel x sequence-parallel); accepted: {_accepted_divisors(world_size)}"
        )
    world = dist.group.WORLD
    cached = _GROUPS.get(size)
    if cached is None or cached[0] is not world:
        check_not_accelerate_deepspeed_sp(size)
        mine = None
        for replica in range(world_size // size):
            ranks = list(range(replica * size, (replica + 1) * size))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        cached = _GROUPS[size] = (
            world,
            SequenceParallelGroups(mine, size, rank % size, world_size // size, rank // size),
        )
    return cached[1]
