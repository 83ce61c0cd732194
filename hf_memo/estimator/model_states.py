"""Model states: parameters, gradients and optimizer state of the whole model and of one rank under DeepSpeed ZeRO
(partitioned, gathered, offloaded), and one rank's budget and peak once its states are added to a step's
activations.

Counts come from a fake copy of the trained model (LoRA applied as asked) with fewer layers, scaled to every layer;
a rank's share follows ZeRO's stage, the persistence threshold and where the optimizer lives.

Without ZeRO the model states are the profile's (AdamW on the model's own weights, its moments in the parameter
dtype: what a plain PyTorch or Hugging Face run of a bf16 model does). With ZeRO they are DeepSpeed's, counted from
its sources (``runtime/zero/stage_1_and_2.py``, ``stage3.py``, ``partitioned_param_coordinator.py``, DeepSpeed 0.19)
for the setup a user runs (:class:`DeepSpeedConfig`): bf16 mixed precision with fp32 master weights, gradient
partition and AdamW moments by default, sharded over all ``N`` ranks; bf16 weights on the device; per rank
(``T`` trainable elements, ``P`` all, ``e`` bytes per weight, ``/N`` the rank's partition):

- ZeRO-1: ``e P`` weights, ``e T`` gradients (kept whole until the step) and the reduce bucket, ``12 T / N`` master
  weights and moments;
- ZeRO-2: the gradient partition ``e T / N``, the running region's gradients before they reach the bucket, the
  reduce bucket (two with ``overlap_comm``); at the step the fp32 copy of the partition, ``4 T / N``, too;
- ZeRO-3: the small parameters every rank keeps whole (``stage3_param_persistence_threshold``), a partition of the
  others and the gathered ones (the running region and its prefetch, up to ``stage3_max_live_parameters``), the
  bf16 gradient partition, one reduce bucket and the fp32 gradient buffer of the largest sub-group beside ``12 T / N``;
- ``offload_optimizer``: master weights, fp32 gradients and moments, ``16 T / N``, plus bf16 staging buffers
  (``e T / N``) live on the host, pinned except the moments; the device keeps only the gradients in flight.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from hf_memo.estimator import fit_cache as fits
from hf_memo.estimator.cluster import FP32, Cluster, DeepSpeedConfig
from hf_memo.estimator.fit_cache import FitCache
from hf_memo.estimator.fitted import ConfigFacts
from hf_memo.estimator.question import SEARCH_LIMIT, Budget, ResolvedModel
from hf_memo.estimator.setups import Lora, dtype_name, torch_dtype, with_lora
from hf_memo.profiler.analysis import Peak
from hf_memo.profiler.footprint import PROFILE_LAYERS, StepProfiler
from hf_memo.profiler.trace import CATEGORIES
from hf_memo.units import format_bytes

if TYPE_CHECKING:  # PyTorch loads when the counts are profiled: cached ones need it not
    import torch
    from torch import nn

    from hf_memo.profiler.fake_model import FakeSession


@dataclass(frozen=True)
class ModelStates:
    """Element counts of the whole model's parameters (what DeepSpeed partitions) and the bytes of one element."""

    parameters: int
    trainable: int
    element_size: int
    largest_region: int  # the largest of a decoder layer, the embedding and the LM head: ZeRO-3 gathers one whole
    largest_region_trainable: int  # its trainable elements: the gradients a region's backward hands over at once
    largest_parameter: int
    persistent: int = 0  # elements of the parameters ZeRO-3 keeps whole on every rank
    optimizer: bool = True  # AdamW (False: no optimizer, no master weights or moments)

    @classmethod
    def of(cls, model: nn.Module, num_layers: int, optimizer: bool, persistence_threshold: int) -> ModelStates:
        """The states of ``model`` with ``num_layers`` decoder layers, from a (fake) copy with fewer: its extra layers
        are the first one's. ``model`` is a ``*ForCausalLM`` or a PEFT model around one."""
        from hf_memo.profiler.phases import decoder_layers

        layer = decoder_layers(model)[0]
        extra = num_layers - len(decoder_layers(model))
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        regions = [layer] + [m for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None]

        def whole(keep: Callable[[nn.Parameter], bool] = _any) -> int:
            return _count(model, keep) + extra * _count(layer, keep)

        def small(p: nn.Parameter) -> bool:
            return p.numel() <= persistence_threshold

        return cls(
            parameters=whole(),
            trainable=whole(_trainable),
            element_size=next(p for p in model.parameters() if p.dim() >= 2).element_size(),
            largest_region=max(_count(region) for region in regions),
            largest_region_trainable=max(_count(region, _trainable) for region in regions),
            largest_parameter=max(p.numel() for p in model.parameters()),
            persistent=whole(small),
            optimizer=optimizer,
        )


def _any(parameter: nn.Parameter) -> bool:
    return True


def _trainable(parameter: nn.Parameter) -> bool:
    return parameter.requires_grad


def _count(module: nn.Module, keep: Callable[[nn.Parameter], bool] = _any) -> int:
    """Elements of ``module``'s parameters that ``keep`` accepts (shared ones once)."""
    return sum(p.numel() for p in module.parameters() if keep(p))


@dataclass(frozen=True)
class RankStates:
    """One rank's DeepSpeed model states, in bytes.

    ``gradients`` is what backward holds; ``gradients_before_backward`` what exists from the forward on (buffers
    DeepSpeed allocates once); ``step_gradients`` what the optimizer step holds instead (ZeRO-1/2 on the device: the
    gradient partition and its fp32 copy), when activations are gone.
    """

    parameters: int
    gathered: int  # of the parameters: ZeRO-3's gathered ones
    gradients: int
    gradients_before_backward: int
    buckets: int  # of the gradients: the reduce buckets
    optimizer: int
    step_gradients: int
    host_pinned: int
    host_pageable: int

    @property
    def host(self) -> int:
        """Host bytes of the rank's offloaded states."""
        return self.host_pinned + self.host_pageable

    def device(self, backward: bool) -> int:
        """Device bytes of the states in backward (``backward``) or before it."""
        gradients = self.gradients if backward else self.gradients_before_backward
        return self.parameters + gradients + self.optimizer

    @property
    def step_total(self) -> int:
        """Device bytes of the states at the optimizer step."""
        return self.parameters - self.gathered + self.step_gradients + self.optimizer


def _gathered(states: ModelStates, config: DeepSpeedConfig) -> int:
    """Elements ZeRO-3 holds gathered at once: the running region, and what it prefetches while it runs (a bucket,
    which may overrun by one parameter), never more than ``stage3_max_live_parameters`` in all, nor more than the
    partitioned parameters."""
    region = states.largest_region
    prefetch = min(config.prefetch_bucket_size + states.largest_parameter, max(config.max_live_parameters - region, 0))
    return min(states.parameters - states.persistent, region + prefetch)


def rank_states(states: ModelStates, cluster: Cluster) -> RankStates:
    """One rank's model states under DeepSpeed ZeRO ``cluster.zero`` (1, 2 or 3): see the module docstring."""
    config, zero, e = cluster.deepspeed, cluster.zero, states.element_size
    part = math.ceil(states.trainable / cluster.num_gpus)  # trainable elements of the rank's partition
    master = (e if config.pure_bf16 else FP32) if states.optimizer else 0
    moments = 2 * master
    grad32 = master  # the gradient partition the optimizer steps with, in the master weights' dtype
    buckets = config.reduce_buckets(zero) * config.reduce_bucket_size * e
    in_flight = states.largest_region_trainable * e
    gathered = e * _gathered(states, config) if zero == 3 else 0
    if zero == 3:  # the rank's partition, the parameters kept whole, the gathered ones
        partitioned = states.parameters - states.persistent
        parameters = e * (math.ceil(partitioned / cluster.num_gpus) + states.persistent) + gathered
    else:
        parameters = e * states.parameters
    offload = cluster.offload_optimizer
    partition = 0 if offload else e * part  # bf16 gradient partition on the device (ZeRO-2/3)
    staging = e * states.largest_parameter if offload and zero < 3 else 0  # a gradient on its way to the host
    if zero == 1:
        before, during = staging, e * states.trainable + buckets + staging
    elif zero == 2:
        before, during = staging, partition + in_flight + buckets + staging
    else:
        before = partition + buckets
        during = before + in_flight
    optimizer = 0 if offload else (master + moments) * part
    if zero == 3 and not offload:
        optimizer += grad32 * min(part, config.sub_group_size)
    step = (e + grad32) * part if zero < 3 and not offload else before
    pinned = (master + grad32 + e) * part + staging if offload else 0
    pageable = moments * part if offload else 0
    if not config.pin_memory:
        pinned, pageable = 0, pinned + pageable
    return RankStates(parameters, gathered, during, before, buckets, optimizer, step, pinned, pageable)


def rank_state_bytes(values: np.ndarray, states: ModelStates, cluster: Cluster) -> np.ndarray:
    """Moments' device bytes by category ``(moments, len(CATEGORIES))`` with the model states a DeepSpeed rank holds
    in place of the profile's (the same values without ZeRO): those of backward where a moment holds gradients,
    else those before it. Which moment is the highest depends on it: a profile's own states (full gradients, AdamW
    moments on the device) weigh backward far more than a rank's do."""
    if cluster.zero == 0:
        return values
    ranked = rank_states(states, cluster)
    column = {category: CATEGORIES.index(category) for category in ("parameter", "gradient", "optimizer")}
    restated = values.copy()
    backward = values[:, column["gradient"]] > 0
    restated[:, column["parameter"]] = ranked.parameters
    restated[:, column["gradient"]] = np.where(backward, ranked.gradients, ranked.gradients_before_backward)
    restated[:, column["optimizer"]] = ranked.optimizer
    return restated


def rank_peak(
    device: Peak, states: ModelStates, cluster: Cluster, extra_temporary: int = 0, restated: bool = False
) -> tuple[Peak, int]:
    """One rank's device peak from a single-GPU peak at the rank's tokens, and the host bytes of its model states.

    Without ZeRO the profile's parameter, gradient and optimizer bytes stay; with ZeRO they are DeepSpeed's
    (:func:`rank_state_bytes`; ``restated``: ``device`` holds them already, chosen among moments that did), or the
    optimizer step's if that holds more. ``extra_temporary`` (all-to-all buffers) is added to the temporaries.
    """
    by_category = dict(device.by_category)
    by_category["temporary"] += extra_temporary
    if cluster.zero == 0:
        return replace(device, total=sum(by_category.values()), by_category=by_category), 0
    ranked = rank_states(states, cluster)
    if not restated:
        values = rank_state_bytes(np.array([[by_category[c] for c in CATEGORIES]]), states, cluster)[0]
        by_category = {c: int(v) for c, v in zip(CATEGORIES, values)}
    total = sum(by_category.values())
    if ranked.step_total + by_category["buffer"] > total:
        step = dict.fromkeys(by_category, 0)
        step.update(
            parameter=ranked.parameters - ranked.gathered,
            gradient=ranked.step_gradients,
            optimizer=ranked.optimizer,
            buffer=by_category["buffer"],
        )
        return Peak(sum(step.values()), step, device.index, "optimizer step"), ranked.host
    return replace(device, total=total, by_category=by_category), ranked.host


def model_states(
    config: Any,
    dtype: str | torch.dtype,
    trainable: str,
    optimizer: str,
    cluster: Cluster,
    lora: Lora | None = None,
    cache: FitCache | None = None,
) -> ModelStates:
    """The whole model's parameter counts, from a fake copy of the trained model (LoRA applied as ``lora`` says, by
    default PEFT's default targets at rank 8) with fewer layers; kept in ``cache`` (and in this process) with the
    closed forms."""
    digest = hashlib.sha256(config.to_json_string().encode()).hexdigest()
    model = ResolvedModel("", ConfigFacts.of(config), digest, lora, SEARCH_LIMIT, lambda: config)
    return _model_states(model, dtype, trainable, optimizer, cluster, lora, cache)


def _model_states(
    model: ResolvedModel,
    dtype: str | torch.dtype,
    trainable: str,
    optimizer: str,
    cluster: Cluster,
    lora: Lora | None,
    cache: FitCache | None,
) -> ModelStates:
    """:func:`model_states` of a resolved model."""
    threshold = cluster.deepspeed.param_persistence_threshold
    key = ("states", model.digest, dtype_name(dtype), trainable, optimizer, lora, threshold)
    cache = cache or FitCache(enabled=False)
    if key not in fits.PROCESS_FITS:
        states = cache.load(cache.key(key))
        if states is None:

            def prepare(fake: nn.Module, session: FakeSession) -> nn.Module:
                return with_lora(fake, session, lora) if trainable == "lora" else fake

            config = model.config()
            fake = StepProfiler(config, prepare, torch_dtype(dtype), 1, optimizer).model(PROFILE_LAYERS[0])
            states = ModelStates.of(fake, model.facts.num_hidden_layers, optimizer == "adamw", threshold)
            cache.store(cache.key(key), states)
        fits.PROCESS_FITS[key] = states
    return fits.PROCESS_FITS[key]


def rank_budget(
    gpu_bytes: int,
    host_bytes: int | None,
    pinned_bytes: int | None,
    reserve: int,
    host_reserve: int,
    cluster: Cluster,
    ranked: RankStates | None,
) -> Budget:
    """One rank's budget: the GPU's memory less ``reserve``; its share of the node's host memory less
    ``host_reserve``; its share of what may be pinned less DeepSpeed's pinned states (``ranked``)."""
    if reserve >= gpu_bytes:
        raise ValueError(f"reserve ({format_bytes(reserve)}) must be less than gpu_memory ({format_bytes(gpu_bytes)})")
    if host_bytes is not None and host_reserve >= host_bytes:
        raise ValueError(
            f"host_reserve ({format_bytes(host_reserve)}) must be less than host_memory ({format_bytes(host_bytes)})"
        )
    ranks = cluster.ranks_per_node
    pinned = None
    if pinned_bytes is not None:
        pinned = max(pinned_bytes / ranks - (ranked.host_pinned if ranked else 0), 0.0)
    host = None if host_bytes is None else (host_bytes - host_reserve) / ranks
    return Budget(float(gpu_bytes - reserve), host, pinned)
