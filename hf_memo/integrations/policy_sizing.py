"""The device bytes of a memo policy on a patched model, from fake-tensor profiles of a copy running that policy.

The runtime decides a step shape's policy with the solver; this sizes the answer as the estimator does
(:mod:`~hf_memo.estimator.policy_footprint`): a few profiles of short steps of copies of the model (same config,
dtype, PEFT adapters and hf_memo config, blocks of 3 and 4 layers, the bottom one 4 and 5) running policies of the
same block structure, with the workspace the attention kernels of the model's device allocate. Each block structure
is profiled once per model and batch size; every length and layer count is then read off its closed form.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from hf_memo.estimator.policy_footprint import PolicyFootprint, PolicyShape, fit_jobs
from hf_memo.estimator.setups import Chunks
from hf_memo.patches.apply import applied_config, apply, causal_lm_of, memo_runtime
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.profiler.fake_model import FakeSession
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.runtime.attention_core import device_target
from hf_memo.runtime.policy_sizer import register_policy_sizer

STATES = ("parameter", "buffer", "gradient", "optimizer")  # what the runtime counts itself (in use, still to come)

# By what a fit depends on (the model's config, adapters, hf_memo config, dtype, device kind, batch size, blocks):
# a model built again in the same process profiles nothing again
_footprints: dict[tuple, PolicyFootprint] = {}


def twin_preparer(
    model: nn.Module, policy: MemoryPolicy | None = None, chunks: Chunks | None = None
) -> Callable[[nn.Module, FakeSession], nn.Module]:
    """``prepare(fake, session)``: make a bare fake copy of ``model``'s causal LM what ``model`` is (PEFT adapters,
    ``hf_memo.apply`` with its config, no planner of its own but fetching as planned steps do if ``model``'s are,
    one rank: under sequence parallelism a rank's shard is profiled as one device's step), running ``policy`` and
    cutting ``(mlp_chunks, lm_head_chunks)`` if given."""
    config = applied_config(model)
    if config is None:
        raise ValueError("a fake copy needs a model patched by hf_memo.apply")
    planned = config.planner != "off"
    config = config.replace(planner="off", sequence_parallel_size=1)
    if chunks is not None:
        config = config.replace(mlp_chunks=chunks[0], lm_head_chunks=chunks[1])
    peft_config = getattr(model, "peft_config", None)

    def prepare(fake: nn.Module, session: FakeSession) -> nn.Module:
        if peft_config is not None:
            from peft import get_peft_model

            with session.converting_modules():
                fake = get_peft_model(fake, copy.deepcopy(next(iter(peft_config.values()))))
        apply(fake, config)
        runtime = memo_runtime(fake)
        if runtime is not None:
            runtime.sizer = None  # a copy's own decisions are not sized (no profile inside a profile)
            runtime.planned_memory = planned
            if policy is not None:
                runtime.assume_policy(policy)
        return fake

    return prepare


def _footprint(model: nn.Module, batch_size: int, kinds: tuple[LayerPolicy, ...]) -> PolicyFootprint:
    target = causal_lm_of(model)
    weight = next(target.parameters())
    peft_config = getattr(model, "peft_config", None)
    key = (
        target.config.to_json_string(),
        repr(peft_config),
        repr(applied_config(model)),
        weight.dtype,
        device_target(weight.device),
        batch_size,
        kinds,
    )
    if key not in _footprints:
        text = target.config.get_text_config()
        max_seq_len = getattr(text, "max_position_embeddings", None) or 1 << 24

        def profiler_for(policy: MemoryPolicy, chunks: Chunks) -> StepProfiler:
            return StepProfiler(
                target.config,
                twin_preparer(model, policy, chunks),
                weight.dtype,
                batch_size,
                optimizer="none",
                fresh=True,
                kernels=device_target(weight.device),
            )

        with torch.random.fork_rng(devices=[]):
            traces = [job() for job in fit_jobs(profiler_for, kinds, max_seq_len)]
        _footprints[key] = PolicyFootprint(kinds, target.config, batch_size, traces, max_seq_len)
    return _footprints[key]


def policy_working_bytes(model: nn.Module, batch_size: int, seq_len: int, policy: MemoryPolicy) -> int:
    """Device bytes a step of ``(batch_size, seq_len)`` of ``model`` running ``policy`` holds at its peak beyond the
    parameters, buffers, gradients and optimizer state (which the runtime counts from the real model)."""
    shape = PolicyShape.of(policy)
    device, _ = _footprint(model, batch_size, shape.kinds).peaks(shape, seq_len)
    return device.total - sum(device.by_category[name] for name in STATES)


register_policy_sizer(policy_working_bytes)
