"""The memory plan of a patched model: profile one step of its shape on fake tensors, then plan it."""

from __future__ import annotations

import torch
from torch import nn

from hf_memo.integrations.policy_sizing import twin_preparer
from hf_memo.patches.apply import applied_config, causal_lm_of, memo_runtime
from hf_memo.planner.bilevel import plan_memory
from hf_memo.planner.plan import MemoryPlan
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.step import trace_training_step
from hf_memo.runtime.attention_core import device_target
from hf_memo.runtime.memo import OffloadDecision
from hf_memo.runtime.model_planner import register_model_planner


def plan_training_step(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    progress: bool = True,
    offload: OffloadDecision | None = None,
) -> MemoryPlan:
    """Plan the memory of one training step of ``model`` on ``(batch_size, seq_len)`` token batches.

    A copy of the model is built on fake tensors (same config, dtype, PEFT adapters and hf_memo
    config, no memory), one step is traced, and the trace is planned with ``MemoConfig.planner``.
    Under ``recompute="memo"`` the copy runs the decision the real model made for that shape (its
    per-layer memory policy and LM-head offload: timings of fake tensors mean nothing); before the real
    model has run that shape, the copy decides it (from its own policy if one was assumed with
    :meth:`~hf_memo.runtime.memo.MemoRuntime.assume_policy`; ``offload_fraction="auto"`` then gives an
    alpha the real run may not choose, and the runtime plans again on its first step). The plan's
    ``meta`` records the shape and the decision it was made for (``meta["offload"]``: every layer's
    policy, the bound and the LM-head offload). Under sequence parallelism, ``seq_len`` is
    one rank's shard, profiled as a single device's step. The trace includes the workspace the attention
    kernels of the real model's device allocate inside their calls (none on the CPU).

    Args:
        model: a model patched by :func:`hf_memo.apply` (or a PEFT model wrapping one).
        progress: show the planner's progress bar.
        offload: the decision to plan for; by default the one ``model``'s runtime made for the shape.
    """
    config = applied_config(model)
    if config is None:
        raise ValueError("plan_training_step needs a model patched by hf_memo.apply")
    target = causal_lm_of(model)
    weight = next(target.parameters())
    kernels = device_target(weight.device)
    fake, session = fake_causal_lm(target.config, weight.dtype)
    with session:
        fake = twin_preparer(model)(fake, session)
        runtime = memo_runtime(model)
        if offload is None and runtime is not None:
            offload = runtime.offload_for(batch_size, seq_len)
        if offload is not None:
            memo_runtime(fake).assume_offload(offload)
        elif runtime is not None and runtime.assumed_policy is not None:
            memo_runtime(fake).assume_policy(runtime.assumed_policy)
        with torch.random.fork_rng(devices=[]):
            trace = trace_training_step(fake, batch_size, seq_len, optimizer="none", kernels=kernels)
        fake_runtime = memo_runtime(fake)
        made_for = None if fake_runtime is None else fake_runtime.offload_for(batch_size, seq_len)
    plan = plan_memory(trace, solver=config.planner, time_limit=config.planner_time_limit, progress=progress)
    if made_for is not None:
        plan.meta["offload"] = made_for.to_dict()
    return plan


register_model_planner(plan_training_step)  # the memo runtime plans a patched model's steps with it
