"""``apply`` and ``revert``: the public way to patch a live model."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn
from transformers import PreTrainedModel

from hf_memo.config import MemoConfig
from hf_memo.patches.patching import patch_model, patch_state, unpatch_model
from hf_memo.runtime.memo import MemoRuntime

ModelT = TypeVar("ModelT", bound=nn.Module)


def causal_lm_of(model: nn.Module) -> PreTrainedModel:
    """The Hugging Face model inside ``model`` (itself, or the base model of a PEFT wrapper)."""
    inner = model
    if not isinstance(inner, PreTrainedModel) and hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    if not isinstance(inner, PreTrainedModel):
        raise TypeError(
            f"hf_memo expects a transformers PreTrainedModel or a PEFT model wrapping one, got {type(model).__name__}"
        )
    return inner


def apply(model: ModelT, config: MemoConfig | None = None, **overrides: Any) -> ModelT:
    """Patch ``model`` in place and return it.

    Args:
        model: a decoder-only ``*ForCausalLM`` (any family whose structure hf_memo recognises, see
            :func:`~hf_memo.patches.structure.describe`), or a PEFT model wrapping one.
        config: the :class:`MemoConfig`; defaults to the config already applied, else ``MemoConfig()``.
        **overrides: fields to change in that config, e.g. ``mlp_chunks=8``.

    Applying again with nothing new is a no-op; applying with a different config re-patches.
    Parameters, buffers and the state dict are untouched, so checkpoints stay plain Transformers.
    """
    target = causal_lm_of(model)
    state = patch_state(target)
    base = config if config is not None else (state.config if state is not None else MemoConfig())
    new_config = base.replace(**overrides) if overrides else base
    if state is not None:
        if new_config == state.config:
            return model
        unpatch_model(target)
    patch_model(target, new_config)
    return model


def revert(model: ModelT) -> ModelT:
    """Undo :func:`apply`: the model behaves exactly (bitwise) as before. Unpatched models are returned as is."""
    unpatch_model(causal_lm_of(model))
    return model


def applied_config(model: nn.Module) -> MemoConfig | None:
    """The :class:`MemoConfig` applied to ``model``, or ``None`` if it is not patched."""
    state = patch_state(causal_lm_of(model))
    return None if state is None else state.config


def check(model: nn.Module, **batch: Any) -> dict[str, Any]:
    """Run hf_memo's self-check (:mod:`~hf_memo.patches.self_check`) on ``model`` now, on ``batch`` (``input_ids``
    ``(B, S)``, optional ``attention_mask``, ``position_ids``, ``labels``), without torch.compile around it: the way
    to check a model that will train compiled, where the check cannot run inside the graph.

    Returns:
        What the check measured (``worst`` relative difference, ``seconds``).

    Raises:
        ValueError: ``model`` is not patched, or the patched model differs from the unpatched one (it is refused).
    """
    target = causal_lm_of(model)
    state = patch_state(target)
    if state is None:
        raise ValueError("hf_memo.check needs a model patched with hf_memo.apply")
    labels = batch.pop("labels", None)
    state.self_check.run(target, batch, {}, labels, again=True)
    return dict(state.self_check.report)


def memo_runtime(model: nn.Module) -> MemoRuntime | None:
    """The memo executor's runtime of a model patched with ``recompute="memo"`` (offload plan, host bytes, ...)."""
    state = patch_state(causal_lm_of(model))
    return None if state is None else state.runtime
