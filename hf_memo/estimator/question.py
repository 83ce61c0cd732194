"""The question an estimate answers, as given: the model (a built-in name, a ``config.json``, a Hub id, a config or
a model), what LoRA trains, the longest length its positions allow, and one rank's budgets of device, host and
pinned memory (:class:`Budget`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_memo.estimator.fit_cache import FitCache
from hf_memo.estimator.fitted import ConfigFacts
from hf_memo.estimator.setups import LORA_RANK, POSITION_LIMITS, Lora, config_of
from hf_memo.profiler.shapes import SHAPE_NAMES

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig


SEARCH_LIMIT = 1 << 24  # the longest sequence searched for, in tokens, unless the model's learned positions stop sooner


def lora_of(
    trainable: str,
    rank: int | None,
    targets: str | Sequence[str] | None,
    modules: str | Sequence[str] | None,
    model_type: str,
) -> Lora | None:
    """What LoRA trains (``None`` for full fine-tuning, where the LoRA settings must be left out), with PEFT's
    default targets for ``model_type`` filled in when ``targets`` is ``None``."""
    if trainable != "lora":
        if rank is not None or targets is not None or modules is not None:
            raise ValueError("lora_rank, lora_targets and trainable_modules apply to trainable='lora' only")
        return None
    lora = Lora(LORA_RANK if rank is None else rank, _names(targets), _names(modules) or ())
    return lora.resolved(model_type)


def _names(names: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """Module names from a sequence or a comma-separated string (``None`` stays ``None``)."""
    if names is None:
        return None
    if isinstance(names, str):
        names = names.split(",")
    return tuple(name.strip() for name in names if name.strip())


@dataclass(frozen=True)
class ResolvedModel:
    """The model of a question as the estimate uses it: its name, what a fit reads of its config, the SHA-256 of
    the config's JSON (what fits are keyed by), what LoRA trains and the longest length its positions allow.
    ``config()`` reads the Transformers config itself, which only profiling needs."""

    name: str
    facts: ConfigFacts
    digest: str
    lora: Lora | None
    search_limit: int
    config: Callable[[], PretrainedConfig] = field(compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("name", "facts", "digest", "lora", "search_limit")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in {**state, "config": _unreadable}.items():
            object.__setattr__(self, name, value)


def _unreadable() -> PretrainedConfig:
    raise RuntimeError("a model read from the cache is bound to its loader by resolve_model")


def _model_source(model: str) -> tuple | None:
    """What a model given by name is, without reading it: a built-in name (its config is hf_memo's code), or a local
    ``config.json`` (its path and contents); ``None`` for a Hub id (read through Transformers every time)."""
    if model in SHAPE_NAMES:
        return ("builtin", model)
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if path.is_file():
        return ("file", str(path.resolve()), hashlib.sha256(path.read_bytes()).hexdigest())
    return None


def resolve_model(
    model_or_config: str | PretrainedConfig | nn.Module,
    trainable: str,
    lora_rank: int | None,
    lora_targets: str | Sequence[str] | None,
    trainable_modules: str | Sequence[str] | None,
    cache: FitCache | None = None,
) -> ResolvedModel:
    """The model of a question (see :class:`ResolvedModel`); a built-in name or a local ``config.json`` asked about
    before is read from ``cache``, without importing Transformers or PEFT (PEFT names LoRA's default targets)."""
    cache = cache or FitCache(enabled=False)
    source = _model_source(model_or_config) if isinstance(model_or_config, str) else None
    loaded: list[PretrainedConfig] = []

    def config() -> PretrainedConfig:
        if not loaded:
            loaded.append(config_of(model_or_config)[1])
        return loaded[0]

    key = None
    if source is not None:
        flags = (trainable, lora_rank, _names(lora_targets), _names(trainable_modules))
        key = cache.key(("model", source, flags))
        found = cache.load(key)
        if isinstance(found, ResolvedModel):
            object.__setattr__(found, "config", config)
            return found
    name, real = config_of(model_or_config)
    loaded.append(real)
    lora = lora_of(trainable, lora_rank, lora_targets, trainable_modules, real.model_type)
    limit_field = POSITION_LIMITS.get(real.model_type)
    search_limit = getattr(real, limit_field) if limit_field else SEARCH_LIMIT
    digest = hashlib.sha256(real.to_json_string().encode()).hexdigest()
    model = ResolvedModel(name, ConfigFacts.of(real), digest, lora, search_limit, config)
    if key is not None:
        cache.store(key, model)
    return model


@dataclass(frozen=True)
class Budget:
    """One rank's memory: device bytes, its share of the node's host memory and of what may be pinned there
    (``None``: no limit)."""

    device: float
    host: float | None = None
    pinned: float | None = None

    def shares(self, device: float, host: float, pinned: float) -> dict[str, float]:
        """The fraction of each budget used (``"device"``, ``"host"``, ``"pinned"``; unlimited ones left out)."""
        shares = {"device": device / self.device}
        if self.host is not None:
            shares["host"] = host / max(self.host, 1.0)
        if self.pinned is not None:
            shares["pinned"] = pinned / max(self.pinned, 1.0)
        return shares

    def stash_room(self, state_host: float) -> float:
        """Host bytes offloaded activations may take beside ``state_host`` bytes of offloaded model states."""
        room = float(2**60)
        if self.host is not None:
            room = min(room, self.host - state_host)
        if self.pinned is not None:
            room = min(room, self.pinned)
        return max(room, 0.0)
