"""The forwards hf_memo installs: mini-sequence MLP, causal LM with the mini-sequence loss, decoder layers.

Each is called as ``impl(config, ..., module, inner, *args, **kwargs)`` where ``inner`` is the
forward it replaced (see :class:`hf_memo.patches.installed.InstalledForward`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import PreTrainedModel

from hf_memo.config import MemoConfig
from hf_memo.minseq.chunking import chunk_bounds, resolve_chunks
from hf_memo.minseq.lm_head import causal_lm_loss
from hf_memo.minseq.mlp import minseq_mlp
from hf_memo.parallel.causal_lm import SequenceParallelLM
from hf_memo.parallel.fsdp import check_parameters_whole
from hf_memo.parallel.groups import check_memo_not_under_deepspeed_ulysses
from hf_memo.parallel.memo_attention import UlyssesAttention
from hf_memo.parallel.zero3 import Zero3Regions, is_partitioned
from hf_memo.patches.backbone import backbone_of
from hf_memo.patches.checkpoint_call import checkpoint_call
from hf_memo.patches.hf_checkpointing import HFCheckpointingTakeover
from hf_memo.patches.inplace_probe import writes_into_kept_outputs
from hf_memo.patches.layer_split import GenericSplit, LayerArguments, eval_mode, find_anatomy, outputs_not_recorded
from hf_memo.patches.mask_packing import masks_see_packing
from hf_memo.patches.packing import describe_training_batch
from hf_memo.patches.probe_mode import trains
from hf_memo.patches.router_logits import (
    RouterLogitsSplit,
    RouterLogitsTap,
    router_aux_loss,
    router_aux_loss_coef,
    wants_router_logits,
)
from hf_memo.patches.self_check import SelfCheck
from hf_memo.patches.structure import Structure
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.batch_layout import LAYOUT_KEYWORD
from hf_memo.runtime.blocked_attention import QueryBlockAttention
from hf_memo.runtime.executor import MemoLayerFunction
from hf_memo.runtime.head_offload import head_input_offloaded
from hf_memo.runtime.memo import MemoRuntime
from hf_memo.runtime.varlen_attention import attention_core_for

logger = logging.getLogger(__name__)


def trainable_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``module`` that currently require a gradient.

    Raises:
        ValueError: ``module`` has no parameters but tensors in their place: a wrapper flattened them away (see
            :mod:`hf_memo.parallel.fsdp`), so hf_memo's autograd functions could not return their gradients.
    """
    params = list(module.parameters())
    if not params and _holds_plain_tensors(module):  # a norm without weights (OLMo's) has none by design
        check_parameters_whole(module, f"no parameters in {type(module).__name__} during a training forward")
    return [p for p in params if p.requires_grad]


def _holds_plain_tensors(module: nn.Module) -> bool:
    """Whether a module of ``module``'s tree holds a tensor attribute that is neither parameter nor buffer: the view
    FSDP1 leaves where it took a parameter away into its flat parameter."""
    return any(isinstance(value, torch.Tensor) for m in module.modules() for value in vars(m).values())


def mlp_forward(
    config: MemoConfig, width: int, module: nn.Module, inner: Callable, x: torch.Tensor, *others: Any, **named: Any
) -> Any:
    """MLP (dense or mixture of experts) over ``x`` ``(B, S, H)`` in mini-sequences; ``width`` is the MLP's
    intermediate size ``I``. Returns what the MLP returns (``(B, S, H)``; gpt-oss: with its ``(B * S, k)`` router
    scores). The router logits of a mixture-of-experts block reach transformers' output recording as one
    ``(B * S, E)`` tensor per router, with gradient (:class:`~hf_memo.patches.router_logits.RouterLogitsTap`).

    An MLP called with more per-token tensors (Bloom's and MPT's residual, ``(B, S, H')``) gets their rows with
    each chunk: they travel as extra columns of the chunked input, so their gradients are the unchunked ones. An MLP
    called with anything else runs whole."""
    if named or not all(_per_token(other, x) for other in others):
        return inner(x, *others, **named)
    tokens = x.numel() // x.shape[-1]
    chunks = resolve_chunks(
        config.mlp_chunks, tokens, width, x.shape[-1], config.min_chunk_tokens, config.max_chunk_elements
    )
    tap = RouterLogitsTap(inner if not others else _columns_split(inner, [x.shape[-1], *(o.shape[-1] for o in others)]))
    joined = torch.cat([x, *others], -1) if others else x
    return tap.recorded(minseq_mlp(tap, joined, trainable_params(module), chunks))


def _per_token(value: Any, x: torch.Tensor) -> bool:
    """Whether ``value`` is a tensor with one row per token of ``x`` ``(B, S, H)``, in ``x``'s dtype."""
    return isinstance(value, torch.Tensor) and value.shape[:-1] == x.shape[:-1] and value.dtype == x.dtype


def _columns_split(inner: Callable, widths: list[int]) -> Callable:
    """``inner(*columns)`` of a ``(..., sum(widths))`` input cut into its columns of ``widths``."""

    def call(joined: torch.Tensor) -> Any:
        return inner(*joined.split(widths, -1))

    return call


class FinalNormDeferral:
    """Whether the backbone's final norm is left to the mini-sequence LM head (during a training loss forward).

    Only the norm's call after the backbone's last decoder layer is deferred: a backbone may call the same norm
    before its layers too (NanoChat normalizes the embeddings with it). Plain attributes rather than context
    variables, so ``torch.compile`` traces the norm (and guards on the flags) with ``fullgraph=True``.

    Attributes:
        active: a training loss forward runs the backbone.
        after_layers: the backbone's last decoder layer ran in this forward.
    """

    def __init__(self) -> None:
        self.active = False
        self.after_layers = False


def final_norm_forward(deferral: FinalNormDeferral, norm: nn.Module, inner: Callable, x: torch.Tensor) -> torch.Tensor:
    """The backbone's final norm over ``x`` ``(B, S, H)``; ``x`` itself after the last decoder layer while the
    causal LM's loss applies the norm inside its mini-sequences."""
    return x if deferral.active and deferral.after_layers else inner(x)


def last_layer_forward(
    deferral: FinalNormDeferral, layer: nn.Module, inner: Callable, *args: Any, **kwargs: Any
) -> Any:
    """The backbone's last decoder layer, which tells ``deferral`` that the backbone's next call of its final norm
    is the one the loss takes over."""
    output = inner(*args, **kwargs)
    deferral.after_layers = True
    return output


def _keeps_all_logits(logits_to_keep: Any) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def causal_lm_forward(
    config: MemoConfig,
    structure: Structure,
    sequence_parallel: SequenceParallelLM | None,
    runtime: MemoRuntime | None,
    deferral: FinalNormDeferral,
    zero3: Zero3Regions,
    self_check: SelfCheck,
    model: PreTrainedModel,
    inner: Callable,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``*ForCausalLM.forward`` whose training loss runs the LM head in mini-sequences.

    In training with ``labels`` (and all logits requested) the backbone runs up to its final norm,
    then the final norm, LM head and loss run in mini-sequences on the ``(B, S, H)`` hidden states:
    neither the ``(B, S, V)`` logits nor the norm's full-length intermediates exist, and only the
    norm's input is kept for backward (on the host under the memo executor, see
    :mod:`hf_memo.runtime.head_offload`). ``logits`` is ``None`` in the output; ``hidden_states``
    (``output_hidden_states=True``) are transformers' own, the last one after the final norm.
    Everything else (evaluation, ``generate()``, calls without labels) goes to the original forward
    unchanged. A mixture-of-experts model collecting router logits (``output_router_logits``, the argument or the
    config) adds ``router_aux_loss_coef`` times its own load-balancing loss to the loss and returns ``aux_loss`` and
    ``router_logits`` (one ``(B * S, E)`` per MoE layer, with gradient in every mode), as transformers does. With
    ``sequence_parallel``, the backbone and the loss run on this rank's shard of the
    sequence and the loss is summed over the sequence-parallel group; the other outputs are the shard's.
    """
    if not trains(model):  # evaluation and generate(): no argument binding, so torch.compile traces it whole
        return _original_forward(model, sequence_parallel, inner, args, kwargs)
    # on every rank, before the first collective of the model's own (the MLP and layer calls would meet it later)
    check_parameters_whole(model, f"{type(model).__name__}'s parameters flattened at a training forward")
    signature = inspect.signature(inner)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    var_keyword = next(n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD)
    extra = dict(arguments.pop(var_keyword, {}))
    labels = arguments.pop("labels", None)
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    if labels is None or not _keeps_all_logits(logits_to_keep):
        return _original_forward(model, sequence_parallel, inner, args, kwargs)
    if self_check.due(model, _sequence(arguments)):
        self_check.run(model, arguments, extra, labels)
    if is_partitioned(model):  # DeepSpeed ZeRO-3: each layer and the loss are gathered whole, once
        zero3.ensure()
    if "use_cache" in signature.parameters:
        arguments["use_cache"] = False  # a training step builds no cache (only then are packed samples detected)
    user_mask = arguments.get("attention_mask")  # the caller's (B, S) mask: the router aux loss counts its tokens
    routed = wants_router_logits(model, arguments.get("output_router_logits", extra.get("output_router_logits")))
    if routed and sequence_parallel is not None:
        raise ValueError(
            "hf_memo does not compute the router aux loss under sequence parallelism (each rank would balance its "
            "own shard of the sequence): pass output_router_logits=False"
        )
    arguments = describe_training_batch(model, arguments, labels, extra, per_sample=sequence_parallel is not None)
    if sequence_parallel is not None:
        arguments, extra = sequence_parallel.shard(arguments, extra, labels)

    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = model.config.return_dict
    backbone = backbone_of(model)
    deferral.active, deferral.after_layers = True, False  # the norm runs per chunk in the loss: its input is kept
    try:
        with masks_see_packing(model.config.model_type, arguments), _layout_seen(structure, arguments):
            outputs = backbone(**arguments, **extra)
    finally:
        deferral.active = deferral.after_layers = False
    hidden = outputs.last_hidden_state
    head, norm = model.get_output_embeddings(), model.get_submodule(structure.final_norm)
    vocab_size = model.config.get_text_config().vocab_size
    tokens = hidden.numel() // hidden.shape[-1]
    chunks = resolve_chunks(
        config.lm_head_chunks, tokens, vocab_size, hidden.shape[-1], config.min_chunk_tokens, config.max_chunk_elements
    )

    def compute(head_forward: Callable, rows: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(
            rows,
            lambda chunk: structure.logits(head_forward(norm(chunk))),
            trainable_params(norm) + trainable_params(head),
            labels,
            chunks,
            ignore_index=extra.get("ignore_index", -100),
            num_items_in_batch=extra.get("num_items_in_batch"),
            shift_labels=extra.get("shift_labels"),
        )

    with head_input_offloaded(runtime, hidden) as head_input:
        loss = zero3.loss(head, head_input, compute)
    if sequence_parallel is not None:
        loss = sequence_parallel.reduce_loss(loss)
    fields = structure.output_class.__dataclass_fields__
    values = {k: v for k, v in outputs.items() if k in fields and k != "logits"}
    if routed:  # as the model's own forward: its load-balancing loss over the router logits of every MoE layer
        values["aux_loss"] = router_aux_loss(model, outputs.router_logits, user_mask)
        loss = loss + router_aux_loss_coef(model) * values["aux_loss"].to(loss.device)
    result = structure.output_class(loss=loss, **values)
    if result.hidden_states is not None:
        result.hidden_states = _normed_last(backbone, norm, result.hidden_states, hidden)
    return result if return_dict else result.to_tuple()


def backbone_forward(
    model: PreTrainedModel,
    zero3: Zero3Regions,
    self_check: SelfCheck,
    backbone: nn.Module,
    inner: Callable,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The backbone's forward. A training forward that did not come through :func:`causal_lm_forward`'s loss (a
    trainer's own LM head, e.g. TRL's ``fused_lm_head``, or a call without labels) gets its batch described here:
    packed and padded rows attend per sample in every mode, and no cache is built; the first runs ``self_check``
    (its probe's labels are the input ids)."""
    if not trains(backbone) or LAYOUT_KEYWORD in kwargs:
        return inner(*args, **kwargs)
    arguments = _bound_arguments(inner, args, kwargs)
    if torch.is_grad_enabled() and self_check.due(model, _sequence(arguments)):
        self_check.run(model, arguments, {}, None)
    if is_partitioned(backbone):
        zero3.ensure()
    if "use_cache" in inspect.signature(inner).parameters:
        arguments["use_cache"] = False
    arguments = describe_training_batch(model, arguments, None, {})
    with masks_see_packing(model.config.model_type, arguments), _layout_seen(self_check.structure, arguments):
        return inner(**arguments)


@contextlib.contextmanager
def _layout_seen(structure: Structure, arguments: dict[str, Any]) -> Iterator[None]:
    """Inside, ``structure.layout`` is the batch description among the backbone's ``arguments`` (``None``: none),
    for decoder layers that their backbone calls without its keyword arguments; afterwards what it was."""
    previous, structure.layout = structure.layout, arguments.get(LAYOUT_KEYWORD)
    try:
        yield
    finally:
        structure.layout = previous


def _sequence(arguments: dict[str, Any]) -> torch.Tensor | None:
    """The ``(B, S)`` input ids, else the ``(B, S, H)`` input embeddings, of a forward's named arguments."""
    ids = arguments.get("input_ids")
    return ids if ids is not None else arguments.get("inputs_embeds")


def _original_forward(
    model: PreTrainedModel, sequence_parallel: SequenceParallelLM | None, inner: Callable, args: tuple, kwargs: dict
) -> Any:
    if sequence_parallel is not None:
        return sequence_parallel.unsplit_forward(model, inner, *args, **kwargs)
    return inner(*args, **kwargs)


def _normed_last(
    backbone: nn.Module, norm: nn.Module, hidden_states: tuple, last: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """``hidden_states`` as transformers returns them: where its last entry is the backbone's ``last_hidden_state``
    (``config.tie_last_hidden_states``, the default), that entry is after the final norm, which the deferred backbone
    skipped. The norm runs here on the full ``(B, S, H)`` ``last``, apart from the loss's mini-sequences."""
    tie_last = getattr(backbone.config, "tie_last_hidden_states", None)
    if not hidden_states or hidden_states[-1] is not last or tie_last is False:
        return hidden_states
    return (*hidden_states[:-1], norm(last))


def _hidden_name(inner: Callable) -> str:
    """The name of the layer forward's first parameter, its hidden states ``(B, S, H)``: ``hidden_states`` in
    transformers' decoder layers, ``hidden`` in RWKV's blocks."""
    return next(iter(inspect.signature(inner).parameters))


def _bound_arguments(inner: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``inner``'s arguments by name, ``**kwargs`` merged in."""
    signature = inspect.signature(inner)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


def memo_layer_forward(
    config: MemoConfig,
    structure: Structure,
    runtime: MemoRuntime,
    sequence_parallel: SequenceParallelLM | None,
    takeover: HFCheckpointingTakeover,
    index: int,
    layer: nn.Module,
    inner: Callable,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Decoder-layer forward under the memo executor (training with gradients); otherwise the original.

    Training forwards without labels run here too (the layer does not know about the head). A layer whose
    checkpoint function is one of one's own (see :meth:`HFCheckpointingTakeover.custom_checkpoint`) runs
    through that function instead: it decides what the layer keeps, and the executor keeps nothing for it.
    """
    if not (trains(layer) and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    return _memo_layer_step(config, structure, runtime, sequence_parallel, takeover, index, layer, inner, args, kwargs)


@torch.compiler.disable  # under torch.compile the executor runs eagerly, between the compiled graphs around it
def _memo_layer_step(
    config: MemoConfig,
    structure: Structure,
    runtime: MemoRuntime,
    sequence_parallel: SequenceParallelLM | None,
    takeover: HFCheckpointingTakeover,
    index: int,
    layer: nn.Module,
    inner: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """A training step of one decoder layer through the memo executor (see :func:`memo_layer_forward`)."""
    arguments = _bound_arguments(inner, args, kwargs)
    custom = takeover.custom_checkpoint(layer)  # transformers' own checkpointing is replaced by the executor's
    if custom is not None:
        return _through_checkpoint_function(custom, takeover, layer, inner, arguments)
    if "hidden_states" not in arguments:
        raise ValueError(
            f"hf_memo cannot run model_type {structure.model_type!r} under recompute='memo': {type(layer).__name__} "
            f"takes its hidden states as {_hidden_name(inner)!r}, not as transformers' decoder layers do "
            "(hidden_states), so it is no decoder layer memo's split knows; use recompute='none', 'full' or "
            "'selective'"
        )
    hidden = arguments["hidden_states"]
    params = trainable_params(layer)
    if not (hidden.requires_grad or params):
        return takeover.call(layer, inner, *args, **kwargs)  # nothing to differentiate: nothing to keep
    if sequence_parallel is None:
        check_memo_not_under_deepspeed_ulysses()
    # the step's samples (transformers' mask for them is not used), from the backbone where it does not pass them on
    layout = arguments.get(LAYOUT_KEYWORD, structure.layout)
    masked = layout is None and arguments.get("attention_mask") is not None
    if masked or arguments.get("encoder_hidden_states") is not None:
        raise ValueError(
            "recompute='memo' takes the samples of a batch from the model's training forward (a 2-D attention_mask "
            "or packed position_ids); it got an attention mask outside such a step (e.g. a 4-D one) or "
            "cross-attention inputs"
        )
    layer_arguments = LayerArguments(arguments, hidden.shape[1])
    needing = layer_arguments.needing_gradient()
    if needing:
        raise ValueError(
            f"hf_memo cannot run model_type {structure.model_type!r} under recompute='memo': {type(layer).__name__} "
            f"gets arguments that need a gradient besides its hidden states ({', '.join(needing)}: computed from "
            "trainable weights outside the layer), and memo's layer function returns gradients for the hidden states "
            "and the layer's own parameters only; use recompute='none', 'full' or 'selective'"
        )
    run = partial(takeover.call, layer, inner)  # the layer's own forward, without Hugging Face's checkpointing
    anatomy = structure.anatomies.get(index)
    if anatomy is None:  # the layer's first memo step: how it feeds its attention, and the split checked
        anatomy = structure.anatomies[index] = find_anatomy(layer, run, layer_arguments, hidden, structure.model_type)
    split = GenericSplit(layer, run, layer_arguments, anatomy)
    width = structure.mlp_width
    # A chunk is S / chunks rows of each of the B sequences: max_chunk_elements bounds its intermediate
    # (B, S / chunks, I) and min_chunk_tokens its B * S / chunks tokens, as in the mini-sequence MLP.
    batch = hidden.shape[0]
    chunks = resolve_chunks(
        config.mlp_chunks,
        hidden.shape[1],
        width,
        hidden.shape[-1],
        -(-config.min_chunk_tokens // batch),
        max(1, config.max_chunk_elements // batch),
    )
    bounds = chunk_bounds(hidden.shape[1], chunks)
    core = attention_core_for(layout)
    if sequence_parallel is not None:  # the exchanged whole sequence attended in query blocks where it may be
        inner = QueryBlockAttention() if isinstance(core, LocalAttention) else core
        core = UlyssesAttention(sequence_parallel.groups.group, sequence_parallel.size, inner)
    with outputs_not_recorded():  # calibration runs the layer on prefixes: transformers records none of it
        alpha_chunks = runtime.alpha_chunks(split, hidden, bounds, core, index)
    y = RouterLogitsSplit.recorded(
        MemoLayerFunction.apply(runtime, RouterLogitsSplit(split), core, index, bounds, alpha_chunks, hidden, *params)
    )
    return (y, *[None] * (anatomy.outputs - 1)) if anatomy.outputs else y  # in the layer's own form


def _keep_matmuls_and_attention(_ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return _keep(SELECTIVE_SAVE_OPS, _ctx, op, *args, **kwargs)


def _keep(saved: frozenset | set, _ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective recompute's policy: keep the outputs of the ``saved`` ops, recompute everything else."""
    # Ops without autograd (e.g. inside the mini-sequence functions' own forward) need nothing saved.
    if op in saved and torch.is_grad_enabled() and not _draws_dropout(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _draws_dropout(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``op`` (a fused attention op) is called with a ``dropout_p`` above zero.

    Such an op draws its dropout mask from the device generator and advances it (CUDA's flash, efficient and
    cuDNN kernels). Saved instead of re-run, the recomputation would not advance the generator, and every
    later dropout of the layer (GPT-2's residual and MLP dropout) would draw another mask than in forward:
    it is recomputed, which replays the forward's mask from the restored RNG state.
    """
    for position, argument in enumerate(op._schema.arguments):
        if argument.name == "dropout_p":
            value = args[position] if position < len(args) else kwargs.get("dropout_p", 0.0)
            return value > 0
    return False


MATMUL_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}
SELECTIVE_SAVE_OPS = MATMUL_OPS | {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def checkpointed_layer_forward(
    config: MemoConfig,
    structure: Structure,
    takeover: HFCheckpointingTakeover,
    index: int,
    layer: nn.Module,
    inner: Callable,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Decoder-layer forward under ``recompute="full"`` (keep the input) or ``"selective"`` (keep matmul and
    attention outputs, recompute norms, activations, RoPE and elementwise ops; a layer that writes in place into a
    matmul's output keeps its attention outputs only, see :mod:`.inplace_probe`).

    The hidden states ``(B, S, H)`` go to ``torch.utils.checkpoint`` positionally: it records the RNG state of
    the devices of its positional tensors only, and the recomputation must draw the forward's dropout masks.
    """
    if not (trains(layer) and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    arguments = _bound_arguments(inner, args, kwargs)
    custom = takeover.custom_checkpoint(layer)
    if custom is not None:
        return _through_checkpoint_function(custom, takeover, layer, inner, arguments)
    hidden, arguments, run = _recomputable(takeover, layer, inner, arguments)
    if config.recompute == "selective":
        saved = structure.selective_saves.get(index)
        if saved is None:  # the layer's first selective step
            saved = structure.selective_saves[index] = _selective_saves(layer, run, hidden, arguments)
        context = partial(create_selective_checkpoint_contexts, partial(_keep, saved))
        return checkpoint_call(run, hidden, context_fn=context, **arguments)
    return checkpoint_call(run, hidden, **arguments)


def selective_saves(writes_into_matmuls: bool) -> frozenset:
    """The ops whose outputs selective recompute keeps for a layer: matmuls and attention, or attention only where
    the layer writes into a matmul's output in place (see :mod:`.inplace_probe`)."""
    return frozenset(SELECTIVE_SAVE_OPS - MATMUL_OPS if writes_into_matmuls else SELECTIVE_SAVE_OPS)


def _selective_saves(layer: nn.Module, run: Callable, hidden: torch.Tensor, arguments: dict[str, Any]) -> frozenset:
    """:func:`selective_saves` for a layer not probed when hf_memo was applied (its weights were not there): probed on
    the first rows of ``hidden`` ``(B, S, H)``; not on fake tensors (the estimator) nor while ``torch.compile``
    traces the step."""
    if is_fake(hidden) or torch.compiler.is_compiling():
        return selective_saves(False)
    rows = hidden[:, :4].detach()
    named = LayerArguments(arguments, hidden.shape[1]).rows(0, rows.shape[1])
    with eval_mode(layer), outputs_not_recorded():
        return selective_saves(writes_into_kept_outputs(lambda: run(rows, **named), MATMUL_OPS))


def _recomputable(
    takeover: HFCheckpointingTakeover, layer: nn.Module, inner: Callable, arguments: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, Any], Callable]:
    """``(hidden_states (B, S, H), the other arguments, run)``: ``run(hidden_states, **others)`` is the layer's forward
    without Hugging Face's checkpointing, writing no KV cache (a recomputation must not write it a second time)."""
    arguments = dict(arguments)
    name = _hidden_name(inner)
    hidden = arguments.pop(name)
    if "past_key_values" in arguments:
        arguments["past_key_values"] = None
    arguments["use_cache"] = False

    def run(hidden_states: torch.Tensor, **named: Any) -> Any:
        return takeover.call(layer, inner, **{name: hidden_states}, **named)

    return hidden, arguments, run


def _through_checkpoint_function(
    function: Callable, takeover: HFCheckpointingTakeover, layer: nn.Module, inner: Callable, arguments: dict[str, Any]
) -> Any:
    """The layer's forward through a checkpoint function of one's own, called as transformers calls it:
    ``function(forward, hidden_states)``."""
    hidden, arguments, run = _recomputable(takeover, layer, inner, arguments)
    return function(partial(run, **arguments), hidden)
