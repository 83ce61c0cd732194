"""Patching one live model of a known family, and undoing it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from transformers import PreTrainedModel

from hf_memo.config import MemoConfig
from hf_memo.parallel.causal_lm import SequenceParallelLM
from hf_memo.parallel.groups import check_memo_not_under_deepspeed_ulysses
from hf_memo.parallel.zero3 import Zero3Regions, head_forward, zero3_expected
from hf_memo.patches.backbone import backbone_of
from hf_memo.patches.forwards import (
    MATMUL_OPS,
    FinalNormDeferral,
    backbone_forward,
    causal_lm_forward,
    checkpointed_layer_forward,
    final_norm_forward,
    last_layer_forward,
    memo_layer_forward,
    mlp_forward,
    selective_saves,
)
from hf_memo.patches.hf_checkpointing import HFCheckpointingTakeover
from hf_memo.patches.inplace_probe import layers_writing_into_kept_outputs
from hf_memo.patches.installed import PatchRecord
from hf_memo.patches.sample_attention import install_sample_attention
from hf_memo.patches.self_check import SelfCheck
from hf_memo.patches.structure import Structure, describe
from hf_memo.runtime.memo import MemoRuntime
from hf_memo.runtime.model_planner import plan_patched_model
from hf_memo.runtime.policy_sizer import size_policy

_STATE_ATTR = "_hf_memo_patch"


@dataclass
class PatchState:
    """What hf_memo did to a model: the config it applied, its structure, how to undo it, the memo runtime."""

    config: MemoConfig
    structure: Structure
    record: PatchRecord
    zero3: Zero3Regions
    self_check: SelfCheck
    runtime: MemoRuntime | None = None


def patch_state(model: PreTrainedModel) -> PatchState | None:
    """The patch on ``model`` (a ``*ForCausalLM``), or ``None`` if it is not patched."""
    return model.__dict__.get(_STATE_ATTR)


def hf_checkpointing_enabled(model: PreTrainedModel) -> bool:
    """Whether Hugging Face gradient (activation) checkpointing is on for ``model``."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def patch_model(model: PreTrainedModel, config: MemoConfig) -> None:
    """Install hf_memo on an unpatched ``model`` (instance-level, reversible).

    Raises:
        ValueError: ``model``'s structure or logits are not ones hf_memo can patch exactly (see
            :func:`~hf_memo.patches.structure.describe`).
    """
    structure = describe(model)
    if config.recompute == "memo" and config.sequence_parallel_size == 1:
        check_memo_not_under_deepspeed_ulysses()
    takeover = HFCheckpointingTakeover(config)
    if config.recompute != "none" and hf_checkpointing_enabled(model):
        takeover.log()
    record = PatchRecord()
    sequence_parallel = SequenceParallelLM.install(model, config, record)  # None unless sequence_parallel_size > 1
    if sequence_parallel is None:  # (Ulysses attends per sample itself)
        install_sample_attention(model, record)
    layers = structure.layers
    if config.recompute == "selective":  # before any step, so torch.compile never traces the probe
        writes = layers_writing_into_kept_outputs(model, layers, MATMUL_OPS) or {}
        structure.selective_saves.update({index: selective_saves(w) for index, w in writes.items()})
    runtime = None
    if config.recompute == "memo":
        planner = partial(plan_patched_model, model) if config.planner != "off" else None
        runtime = MemoRuntime(config, len(layers), planner, model.parameters, partial(size_policy, model))
    if runtime is None:  # the memo executor cuts the MLP into mini-sequences itself
        for mlp in structure.mlps:
            record.install_forward(mlp, partial(mlp_forward, config, structure.mlp_width))
    for index, layer in enumerate(layers):
        if runtime is not None:
            record.install_forward(
                layer, partial(memo_layer_forward, config, structure, runtime, sequence_parallel, takeover, index)
            )
        elif config.recompute in ("full", "selective"):
            record.install_forward(layer, partial(checkpointed_layer_forward, config, structure, takeover, index))
    backbone = backbone_of(model)
    deferral = FinalNormDeferral()
    norm, head = model.get_submodule(structure.final_norm), model.get_output_embeddings()
    record.install_forward(norm, partial(final_norm_forward, deferral))
    record.install_forward(layers[-1], partial(last_layer_forward, deferral))
    zero3 = Zero3Regions([(layer, [layer]) for layer in layers] + [(head, [head, norm])], head)
    record.install_forward(head, partial(head_forward, zero3.head_region))
    # not under sequence parallelism, whose shards a few probe rows do not fill
    checked = config.self_check and sequence_parallel is None
    check = SelfCheck(config.recompute, structure, record, repr(config), checked, runtime, zero3)
    if sequence_parallel is None:  # (sequence parallelism shards and describes batches in its own forward)
        record.install_forward(backbone, partial(backbone_forward, model, zero3, check))
    record.install_forward(
        model, partial(causal_lm_forward, config, structure, sequence_parallel, runtime, deferral, zero3, check)
    )
    if zero3_expected(model):  # registered before DeepSpeed records its first trace of the model
        zero3.ensure()
    model.__dict__[_STATE_ATTR] = PatchState(config, structure, record, zero3, check, runtime)


def unpatch_model(model: PreTrainedModel) -> None:
    """Undo :func:`patch_model`; a model that is not patched is left as it is."""
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is not None:
        state.zero3.undo()
        state.record.undo()
