"""hf_memo's sequence parallelism with Accelerate: groups built from the Accelerator, data loaders per replica.

With ``MemoConfig(sequence_parallel_size=sp)`` the world of ``accelerator.num_processes`` ranks is
``world / sp`` data-parallel replicas of ``sp`` ranks each. Every rank of a replica must see the same
batches (the model cuts them along the sequence itself), so data loaders are split over the replicas
only. Gradients are averaged over the whole world by DDP or DeepSpeed ZeRO (any stage; under stage 3 see
:mod:`hf_memo.parallel.zero3`), which the model's loss accounts for::

    accelerator = Accelerator()
    model = hf_memo.apply(model, sequence_parallel_size=4)
    attach(accelerator, model)  # before accelerator.prepare(...)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    attach(trainer.accelerator, trainer.model)  # before trainer.train()

Accelerate's own DeepSpeed sequence parallelism (``ParallelismConfig(sp_size=N, sp_backend="deepspeed")``,
DeepSpeed-Ulysses/ALST) is the alternative on DeepSpeed: there DeepSpeed shards the batches and wraps
attention, and hf_memo is applied with ``sequence_parallel_size=1`` so that its mini-sequence MLP and
LM head run on DeepSpeed's shards (the patched forward honours the ``shift_labels`` it passes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from accelerate import Accelerator, DistributedType
from accelerate.data_loader import prepare_data_loader as accelerate_prepare_data_loader
from torch import nn
from torch.utils.data import DataLoader

from hf_memo.parallel.groups import SequenceParallelGroups, sequence_parallel_groups
from hf_memo.patches import applied_config


def _check_no_deepspeed_sequence_parallelism(accelerator: Accelerator, size: int) -> None:
    config = accelerator.parallelism_config
    if config is not None and config.sp_enabled:
        raise ValueError(
            f"MemoConfig.sequence_parallel_size={size} and Accelerate's ParallelismConfig(sp_size={config.sp_size}, "
            f"sp_backend={config.sp_backend!r}) would both split the sequence; use one: hf_memo.apply(model, "
            "sequence_parallel_size=1) with Accelerate's DeepSpeed sequence parallelism, or hf_memo's without sp_size"
        )


def sequence_parallel_size_of(model: nn.Module) -> int:
    """The ``sequence_parallel_size`` hf_memo applied to ``model`` (1 if it is not patched)."""
    config = applied_config(model)
    return 1 if config is None else config.sequence_parallel_size


def prepare_data_loader(
    accelerator: Accelerator,
    groups: SequenceParallelGroups,
    data_loader: DataLoader,
    device_placement: bool | None = None,
    slice_fn_for_dispatch: Callable | None = None,
) -> DataLoader:
    """``accelerator.prepare_data_loader``, but split over the data-parallel replicas only.

    Ranks of one sequence-parallel group get the same batches; replicas get different ones. All
    of the accelerator's data-loading settings (seedable sampler, even batches, RNG sync, device
    placement) apply as they would without sequence parallelism.
    """
    if getattr(data_loader, "_is_accelerate_prepared", False):
        return data_loader
    if device_placement is None:
        device_placement = accelerator.device_placement
    prepared = accelerate_prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=groups.dp_size,
        process_index=groups.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=accelerator.dispatch_batches,
        even_batches=accelerator.even_batches,
        slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    accelerator._dataloaders.append(prepared)  # as Accelerator.prepare_data_loader does, for save/load_state
    return prepared


def attach(accelerator: Accelerator, model: nn.Module) -> SequenceParallelGroups:
    """Set ``accelerator`` up for the sequence parallelism hf_memo applied to ``model``; return this rank's groups.

    Checks, on every rank and before any step, that the accelerator runs distributed with a world
    size that is a multiple of the sequence-parallel degree, builds the groups (world =
    data-parallel x sequence-parallel), and makes ``accelerator.prepare`` /
    ``accelerator.prepare_data_loader`` split data loaders over the data-parallel replicas only.
    Call it before preparing the data loaders (with the Trainer: after constructing it, before ``train()``).

    Raises:
        ValueError: ``model`` has no sequence parallelism applied, the accelerator is not distributed,
            the world size is not a multiple of the degree, or Accelerate's own sequence parallelism is on.
    """
    size = sequence_parallel_size_of(model)
    if size == 1:
        raise ValueError(
            "attach() sets up hf_memo's sequence parallelism, but the model has none applied: "
            "hf_memo.apply(model, sequence_parallel_size=N) first"
        )
    _check_no_deepspeed_sequence_parallelism(accelerator, size)
    if accelerator.distributed_type == DistributedType.NO or accelerator.num_processes == 1:
        raise ValueError(
            f"MemoConfig.sequence_parallel_size={size} needs a distributed Accelerator, but this one runs "
            f"{accelerator.num_processes} process ({accelerator.distributed_type}): launch with "
            "`accelerate launch` (see examples/accelerate_configs/)"
        )
    groups = sequence_parallel_groups(size)
    accelerator.prepare_data_loader = functools.partial(prepare_data_loader, accelerator, groups)
    return groups
