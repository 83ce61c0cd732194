"""The memory plan of a patched model: profile one step of its shape on fake tensors, then plan it."""

from __future__ import annotations

import copy

import torch
from torch import nn

from hf_memo.planner.bilevel import plan_memory
from hf_memo.planner.plan import MemoryPlan
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.step import trace_training_step


def plan_training_step(model: nn.Module, batch_size: int, seq_len: int, progress: bool = True) -> MemoryPlan:
    """Plan the memory of one training step of ``model`` on ``(batch_size, seq_len)`` token batches.

    A copy of the model is built on fake tensors (same config, dtype, PEFT adapters and hf_memo
    config, no memory), one step is traced, and the trace is planned with ``MemoConfig.planner``.
    The plan's ``meta`` records the shape it was made for. Under sequence parallelism, ``seq_len`` is
    one rank's shard, profiled as a single device's step.

    Args:
        model: a model patched by :func:`hf_memo.apply` (or a PEFT model wrapping one).
        progress: show the planner's progress bar.
    """
    from hf_memo.patches.apply import applied_config, apply, causal_lm_of

    config = applied_config(model)
    if config is None:
        raise ValueError("plan_training_step needs a model patched by hf_memo.apply")
    target = causal_lm_of(model)
    fake, session = fake_causal_lm(target.config, next(target.parameters()).dtype)
    with session:
        peft_config = getattr(model, "peft_config", None)
        if peft_config is not None:
            from peft import get_peft_model

            with session.converting_modules():
                fake = get_peft_model(fake, copy.deepcopy(next(iter(peft_config.values()))))
        # ``seq_len`` is this rank's shard under sequence parallelism: it is profiled as one device's step
        # (the executor's buffers hold the shard's activations; the attention statistics it keeps in the
        # exchanged layout have the same size as the shard's).
        apply(fake, config.replace(planner="off", sequence_parallel_size=1))
        with torch.random.fork_rng(devices=[]):
            trace = trace_training_step(fake, batch_size, seq_len, optimizer="none")
    return plan_memory(trace, solver=config.planner, time_limit=config.planner_time_limit, progress=progress)
