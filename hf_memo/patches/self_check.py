"""The self-check: on a model's first training step, hf_memo's patched model against the unpatched one.

hf_memo's promise is the unpatched model's loss and gradients. Its patches assume that a family computes what
the families its tests build compute; a family that branches on the attention implementation's name, builds
masks inside its layers or passes its layers fixed arguments takes another path. No list of families can
foresee them, so every patched model checks itself, whatever its mode, before any gradient reaches the optimizer:

1. The step's own batch, cut to its first ``PROBE_TOKENS`` positions of up to ``PROBE_ROWS`` rows (its mask,
   positions, packing and labels cut alike), goes through the model twice with every module in eval mode (no
   dropout): with every patch suspended (transformers' own forwards, attention implementation and masks), and
   patched (hf_memo's training path in its mode: mini-sequence MLP and loss, per-sample attention, recomputation,
   the memo executor).
2. Compared: every decoder layer's output (relative to the change the layer makes to its input), the loss, and one
   vector-Jacobian product: the gradient of the loss plus a random projection of the output of the first layer of
   each kind, with respect to the embeddings' output and the trainable parameters of those layers, the final norm
   and the head. A lost causal or learned mask is an ``O(1)`` difference; chunking re-associates sums and differs
   by rounding (:data:`TOLERANCE` per compute dtype).
3. A difference beyond rounding, or an error only the patched run raises, first drops hf_memo's per-sample
   attention (the layers attend with transformers' masks, as under eager attention) and checks again; what still
   differs refuses the model, naming its class, the layer and the difference. Where the unpatched model itself
   fails on the probe there is nothing to compare with, and the model is refused with that error too.

The probe is a few dozen tokens: its cost is two forward and backward passes of that many tokens, on the first step
of each kind of batch (plain, padded, packed), once per configuration in a process. It leaves the random
generators and the memo executor's first-step findings as it found them. On parameters FSDP2 or ZeRO-3 shard it
runs with the parameters they gather, every rank on its own rows, its decisions agreed over the ranks
(:mod:`~hf_memo.patches.self_check_sharding`); its gradients never reach ``.grad`` nor the shardings' reductions.
It does not run inside a torch.compile graph, on fake tensors (the estimator's profiles), under sequence
parallelism (whose shards the probe's rows do not fill), on a padded batch of packed samples (where transformers
itself attends across the samples), nor with ``MemoConfig(self_check=False)``; :func:`hf_memo.check` runs it on
demand (e.g. before compiling).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PreTrainedModel

from hf_memo.patches.installed import InstalledForward
from hf_memo.patches.layer_split import rng_untouched
from hf_memo.patches.probe_mode import probing
from hf_memo.patches.sample_attention import attends_per_sample, uninstall_sample_attention
from hf_memo.patches.self_check_sharding import all_ranks, any_rank, gather_root, gathered
from hf_memo.patches.structure import Structure
from hf_memo.planner.policy_solver import PolicyDoesNotFit

logger = logging.getLogger(__name__)

PROBE_ROWS = 2
PROBE_TOKENS = 32
# What a relative difference may be in each compute dtype and still be rounding: chunked sums, per-sample kernels
# and fp32 softmax or norms inside fp64 models differ from the unpatched model by 1e-7 to 1e-6 in fp64.
TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}
_TINY = 1e-30


class SelfCheckError(ValueError):
    """The patched model does not compute what the unpatched model computes (see the module docstring)."""


@dataclass
class _Run:
    """One pass of the probe: the loss, every decoder layer's ``(input, output)`` ``(b, P, H)`` and the gradients
    of the checked tensors (``None`` where one gets none)."""

    loss: torch.Tensor
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    gradients: dict[str, torch.Tensor | None]


@dataclass
class _Difference:
    where: str
    value: float


# What passed in this process: (model class, config, modules, trainable parameters, hf_memo's settings, dtype, batch
# kind) -> whether hf_memo's per-sample attention stayed. The check proves code paths, which weights do not change:
# a model built again from the same config (a test suite, a hyper-parameter search) is not probed again.
_PASSED: dict[tuple, bool] = {}
BATCH_KINDS = ("plain", "padded", "packed")


@dataclass
class SelfCheck:
    """The self-check of one patched model (see the module docstring).

    Attributes:
        mode: the ``MemoConfig.recompute`` checked (for messages).
        structure: the model's :class:`~hf_memo.patches.structure.Structure`.
        record: the patch record, suspended for the unpatched pass.
        settings: hf_memo's config (``repr``), part of what a passed check is remembered by.
        runtime: the memo executor's :class:`~hf_memo.runtime.memo.MemoRuntime` (``None`` in the other modes), which
            the probe must leave as it found it.
        zero3: the model's :class:`~hf_memo.parallel.zero3.Zero3Regions`, whose gradient reductions the probe's
            backward must not run.
        enabled: ``MemoConfig.self_check`` (and no sequence parallelism).
        checked: the kinds of batch (:data:`BATCH_KINDS`) the model passed on; each kind is checked on its first
            training step, since padding and packing take other paths.
        report: what the last check measured (worst relative difference, seconds), for logs and tests.
    """

    mode: str
    structure: Structure
    record: Any
    settings: str
    enabled: bool = True
    runtime: Any = None
    zero3: Any = None
    checked: set[str] = field(default_factory=set)
    report: dict[str, Any] = field(default_factory=dict)
    _running: bool = False

    def due(self, model: PreTrainedModel, sample: torch.Tensor | None) -> bool:
        """Whether this training forward (its input ids or embeddings ``sample``) may need the check first: not
        inside a torch.compile graph, where the check cannot run (:func:`hf_memo.check` runs it before compiling)."""
        if torch.compiler.is_compiling() or not self.enabled or self._running:
            return False
        return not (sample is None or is_fake(sample) or len(self.checked) == len(BATCH_KINDS))

    @torch.compiler.disable
    def run(
        self, model: PreTrainedModel, arguments: dict[str, Any], extra: dict[str, Any], labels: Any, again: bool = False
    ) -> None:
        """Check ``model`` on the batch of this training forward (its bound named ``arguments``, its ``**kwargs``
        ``extra`` and ``labels`` ``(B, S)`` or ``None``), unless its kind of batch passed already (``again``: check
        anyway).

        Raises:
            SelfCheckError: the patched model differs from the unpatched one beyond rounding.
        """
        kind = batch_kind(arguments)
        wanted = again or kind not in self.checked
        if kind == "padded" and batch_kind({"position_ids": arguments.get("position_ids")}) == "packed":
            logger.debug("hf_memo's self-check skips padded packed samples: transformers attends across them")
            wanted = False
        key = self._key(model, kind)
        if wanted and key in _PASSED and not again:
            if not _PASSED[key] and attends_per_sample(model):
                uninstall_sample_attention(model, self.record)
            self.checked.add(kind)
            wanted = False
        inputs = probe_inputs(arguments, extra, labels)
        # sharded, every rank probes (each gather is a collective) once one rank wants to and all ranks can
        if not any_rank(model, wanted) or not all_ranks(model, inputs is not None):
            if wanted:
                logger.debug("hf_memo's self-check waits for a batch with real tokens in its first positions")
            return
        self._running = True
        start = time.perf_counter()
        found = set(self.structure.anatomies)
        try:
            runtime = self.runtime.probe() if self.runtime is not None else contextlib.nullcontext()
            reductions = self.zero3.reductions_paused() if self.zero3 is not None else contextlib.nullcontext()
            with rng_untouched(model), runtime, reductions:  # the step draws the dropout masks it would draw unchecked
                self._check(model, inputs)
        finally:
            self._running = False
            gather_root(model)  # for the step's own forward
            for index in set(self.structure.anatomies) - found:  # found in eval mode: without the step's dropout
                del self.structure.anatomies[index]
        self.checked.add(kind)
        _PASSED[key] = attends_per_sample(model)
        self.report["seconds"] = time.perf_counter() - start
        logger.info("hf_memo's self-check passed for %s on a %s batch: %s", type(model).__name__, kind, self.report)

    def _key(self, model: PreTrainedModel, kind: str) -> tuple:
        """What a passed check is remembered by (see :data:`_PASSED`)."""
        modules = tuple((name, type(module).__qualname__) for name, module in model.named_modules())
        trainable = tuple(name for name, p in model.named_parameters() if p.requires_grad)
        parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
        dtype = None if parameter is None else parameter.dtype
        config = model.config.to_json_string(use_diff=False)
        return type(model), config, hash(modules), hash(trainable), self.settings, dtype, _tolerance(model), kind

    def _check(self, model: PreTrainedModel, inputs: dict[str, Any]) -> None:
        self._check_training_draws(model, inputs["input_ids"].shape[-1] if "input_ids" in inputs else PROBE_TOKENS)
        layers = self.structure.layers
        probed = first_of_each_kind(model, layers)
        targets = _targets(model, self.structure, probed)
        generator = torch.Generator().manual_seed(0)
        cotangents: dict[int, torch.Tensor] = {}
        reference: _Run | None = None
        failed: BaseException | None = None
        try:
            with self.record.suspended():
                reference = _run(model, inputs, layers, probed, targets, cotangents, generator)
        except Exception as error:  # nothing to compare with: training unchecked would break the promise
            failed = error
        if any_rank(model, failed is not None):
            raise self._unchecked(model, failed)
        if any_rank(model, not torch.isfinite(reference.loss).all()):
            logger.warning("hf_memo's self-check skipped: the unpatched model's loss on the probe is not finite")
            return
        tolerance = _tolerance(model)
        failure = self._patched_difference(model, inputs, layers, probed, targets, cotangents, reference, tolerance)
        if _is_refusal(failure):
            raise failure
        if failure is not None and attends_per_sample(model):
            uninstall_sample_attention(model, self.record)
            retried = self._patched_difference(model, inputs, layers, probed, targets, cotangents, reference, tolerance)
            if retried is None:
                logger.info(
                    "hf_memo attends with transformers' masks in %s: its per-sample attention differed (%s)",
                    type(model).__name__,
                    failure,
                )
                self.report["per_sample_attention"] = False
                return
            failure = retried
        if failure is None:
            return
        with _whole_mlps(self.structure) as switched:
            mixes = switched and not self._patched_difference(
                model, inputs, layers, probed, targets, cotangents, reference, tolerance
            )
        if mixes:  # exact with each MLP over the whole sequence: the MLP is not a per-token function
            found = failure.where if isinstance(failure, _Difference) else f"{type(failure).__name__}: {failure}"
            raise SelfCheckError(
                f"hf_memo cannot train {type(model).__name__} (model_type {model.config.model_type!r}) with "
                f"recompute={self.mode!r}: its MLP ({type(self.structure.mlps[0]).__name__}) run in mini-sequences "
                f"differs from it run whole ({found}): it mixes the tokens of the sequence (e.g. a router over the "
                "whole batch), which no mini-sequence can reproduce"
            )
        raise self._refusal(model, failure, tolerance)

    def _check_training_draws(self, model: PreTrainedModel, tokens: int) -> None:
        """Refuse an MLP that draws random numbers more than once per call in training (PhiMoE's sampled routing):
        the probe runs in eval mode and cannot see them, and mini-sequences would draw them in another order than
        the whole sequence does (one draw per call, as a dropout, keeps its order)."""
        hidden = model.config.get_text_config().hidden_size
        seen: set[type] = set()
        for layer, mlp in zip(self.structure.layers, self.structure.mlps):
            if type(mlp) in seen or not mlp.training:
                continue
            seen.add(type(mlp))
            parameter = next(mlp.parameters(), None)
            if parameter is None:
                continue
            draws = _RandomDraws()
            try:
                with gathered(layer, mlp):
                    local = next(mlp.parameters())
                    x = torch.randn(1, tokens, hidden, dtype=local.dtype, device=local.device)
                    with self.record.suspended(), torch.no_grad(), draws:  # the model's own MLP, not mini-sequences
                        mlp(x)
            except Exception:  # an MLP that takes more than the hidden states (Bloom's residual): nothing to tell
                continue
            if len(draws.ops) > 1:
                raise SelfCheckError(
                    f"hf_memo cannot train {type(model).__name__} (model_type {model.config.model_type!r}) with "
                    f"recompute={self.mode!r}: its MLP ({type(mlp).__name__}) draws random numbers {len(draws.ops)} "
                    f"times per call in training ({', '.join(draws.ops)}: e.g. sampled routing), which mini-sequences "
                    "would draw in another order than the whole sequence, so its training would differ from the "
                    "unpatched model's; train it unpatched (hf_memo.revert)"
                )

    def _patched_difference(
        self,
        model: PreTrainedModel,
        inputs: dict[str, Any],
        layers: list[nn.Module],
        probed: list[int],
        targets: list[_Target],
        cotangents: dict[int, torch.Tensor],
        reference: _Run,
        tolerance: float,
    ) -> _Difference | BaseException | None:
        """The first difference beyond ``tolerance`` of the patched run from ``reference``, the error the patched run
        raised, or ``None``."""
        try:
            patched = _run(model, inputs, layers, probed, targets, cotangents, None)
        except (SelfCheckError, PolicyDoesNotFit):  # a memory budget that no policy fits: not a difference
            raise
        except Exception as error:
            failure: _Difference | BaseException | None = error
        else:
            differences = _differences(reference, patched, layers, tolerance)
            self.report["worst"] = max((d.value for d in differences), default=0.0)
            failure = next((d for d in differences if not d.value <= tolerance), None)
        if any_rank(model, failure is not None) and failure is None:  # every rank takes the same way on
            failure = _Difference("the probe on another rank (see its error)", math.inf)
        return failure

    def _unchecked(self, model: PreTrainedModel, failed: BaseException | None) -> SelfCheckError:
        """The refusal of a model whose unpatched forward fails on the probe's rows (``failed``; ``None``: on
        another rank), so that nothing can be compared."""
        cause = f"{type(failed).__name__}: {failed}" if failed is not None else "on another rank (see its error)"
        error = SelfCheckError(
            f"hf_memo cannot check {type(model).__name__} (model_type {model.config.model_type!r}) with "
            f"recompute={self.mode!r}: the unpatched model fails on the self-check's probe (the step's first "
            f"{PROBE_TOKENS} positions of up to {PROBE_ROWS} rows) {cause}. hf_memo trains a model only after "
            "comparing it with the unpatched one; set MemoConfig(self_check=False) to train it patched unchecked, "
            "or train it unpatched (hf_memo.revert)"
        )
        error.__cause__ = failed
        return error

    def _refusal(self, model: PreTrainedModel, failure: _Difference | BaseException, tolerance: float) -> Exception:
        name = f"{type(model).__name__} (model_type {model.config.model_type!r})"
        if _is_refusal(failure):
            return failure
        if isinstance(failure, BaseException):
            error = SelfCheckError(
                f"hf_memo cannot train {name} with recompute={self.mode!r}: the patched training step fails where the "
                f"unpatched one runs ({type(failure).__name__}: {failure})"
            )
            error.__cause__ = failure
            return error
        return SelfCheckError(
            f"hf_memo cannot train {name} exactly with recompute={self.mode!r}: its self-check on the first training "
            f"step finds {failure.where} differing from the unpatched model by {failure.value:.3g} (relative; "
            f"rounding in this dtype stays below {tolerance:g}). Train it unpatched (hf_memo.revert), or set "
            "MemoConfig(self_check=False) to train it as patched anyway"
        )


@contextlib.contextmanager
def _whole_mlps(structure: Structure) -> Iterator[bool]:
    """Inside, every MLP hf_memo runs in mini-sequences runs whole (its installed forward switched off); yields
    whether there was any."""
    installed = [
        m.__dict__["forward"] for m in structure.mlps if isinstance(m.__dict__.get("forward"), InstalledForward)
    ]
    active = [forward.active for forward in installed]
    for forward in installed:
        forward.active = False
    try:
        yield bool(installed)
    finally:
        for forward, was in zip(installed, active):
            forward.active = was


def batch_kind(arguments: dict[str, Any]) -> str:
    """``"padded"`` (an ``attention_mask`` with zeros), ``"packed"`` (``position_ids`` that restart or jump inside a
    row) or ``"plain"``: the kind of batch of a training forward's named ``arguments``."""
    mask = arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        return "padded"
    positions = arguments.get("position_ids")
    steps = positions[..., 1:] - positions[..., :-1] if isinstance(positions, torch.Tensor) else None
    if steps is not None and not bool((steps == 1).all()):
        return "packed"
    return "plain"


def _is_refusal(failure: Any) -> bool:
    """Whether ``failure`` is hf_memo's own refusal (a ``ValueError`` naming hf_memo and the cause)."""
    return isinstance(failure, ValueError) and str(failure).startswith("hf_memo")


def probe_inputs(arguments: dict[str, Any], extra: dict[str, Any], labels: Any) -> dict[str, Any] | None:
    """The causal LM's keyword arguments for the probe: the first ``PROBE_TOKENS`` positions of up to ``PROBE_ROWS``
    rows of the step's batch (each ``(B, S, ...)`` tensor cut alike, ``(k, B, S)`` positions too), labels made
    from the input ids where the step has none, no ``num_items_in_batch`` (the probe's loss is a mean), no cache.
    ``None`` when no row has a real token (``attention_mask`` 1) in those positions."""
    sequence = arguments.get("input_ids")
    if sequence is None:
        sequence = arguments.get("inputs_embeds")
    batch, length = sequence.shape[:2]
    mask = arguments.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return None
    tokens = min(length, PROBE_TOKENS)
    rows = [r for r in range(batch) if mask is None or bool(mask[r, :tokens].any())][:PROBE_ROWS]
    if not rows:
        return None
    index = torch.tensor(rows, device=sequence.device)

    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        if value.dim() >= 2 and tuple(value.shape[:2]) == (batch, length):
            return value.index_select(0, index.to(value.device))[:, :tokens]
        if value.dim() >= 3 and tuple(value.shape[1:3]) == (batch, length):
            return value.index_select(1, index.to(value.device))[:, :, :tokens]
        if tuple(value.shape) == (length,):
            return value[:tokens]
        return value

    inputs = {name: cut(value) for name, value in {**arguments, **extra}.items() if name != "num_items_in_batch"}
    if inputs.get("attention_mask") is not None and bool(inputs["attention_mask"].all()):
        del inputs["attention_mask"]  # as hf_memo reads it: a mask of no padding would hide packed samples
    if labels is None and inputs.get("input_ids") is not None:
        labels = inputs["input_ids"].clone()
        if inputs.get("attention_mask") is not None:
            labels[inputs["attention_mask"] == 0] = -100
        inputs["labels"] = labels
    elif labels is not None:
        inputs["labels"] = cut(labels)
    for name in ("past_key_values", "cache"):
        inputs.pop(name, None)
    inputs.update(use_cache=False, return_dict=True, logits_to_keep=0)
    return inputs


class _RandomDraws(TorchDispatchMode):
    """Records the seeded random ops (dropout masks, sampling, noise) run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def first_of_each_kind(model: PreTrainedModel, layers: list[nn.Module]) -> list[int]:
    """The index of the first decoder layer of each kind: the same module classes under the same names, and the
    same entry of the config's ``layer_types`` (sliding or full attention, ...)."""
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    seen: dict[tuple, int] = {}
    for index, layer in enumerate(layers):
        tree = tuple((name, type(module).__qualname__) for name, module in layer.named_modules())
        kind = (tree, types[index] if index < len(types) else None)
        seen.setdefault(kind, index)
    return sorted(seen.values())


@dataclass(frozen=True)
class _Target:
    """A trainable parameter the vector-Jacobian product is taken for: ``owner``'s parameter ``name`` (taken as the
    owner sees it in its forward: FSDP2 puts its gathered parameters there), ``label`` for messages."""

    label: str
    owner: nn.Module
    name: str


def _targets(model: PreTrainedModel, structure: Structure, probed: list[int]) -> list[_Target]:
    """The trainable parameters the vector-Jacobian product is taken for: those of the first layer of each kind, the
    final norm and the head."""
    modules = [(f"decoder layer {i} ({type(structure.layers[i]).__name__})", structure.layers[i]) for i in probed]
    modules.append(("the final norm", model.get_submodule(structure.final_norm)))
    modules.append(("the LM head", model.get_output_embeddings()))
    seen: set[int] = set()
    targets = []
    for owner, module in modules:
        for name, parameter in module.named_parameters():
            if parameter.requires_grad and id(parameter) not in seen:
                seen.add(id(parameter))
                targets.append(_Target(f"{owner}: {name}", module, name))
    return targets


def _first_tensor(value: Any) -> torch.Tensor:
    while isinstance(value, (tuple, list)):
        value = value[0]
    return value


def _run(
    model: PreTrainedModel,
    inputs: dict[str, Any],
    layers: list[nn.Module],
    probed: list[int],
    targets: list[_Target],
    cotangents: dict[int, torch.Tensor],
    generator: torch.Generator | None,
) -> _Run:
    """One pass of the model over the probe's ``inputs`` in eval mode, its loss plus each probed layer's output
    projected on a random ``cotangents`` entry (drawn from ``generator`` when missing) differentiated."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    leaf: list[torch.Tensor] = []

    def embedded(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        leaf.append(out.detach().requires_grad_())
        return leaf[-1]

    def recorder(index: int) -> Callable:
        def record(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            captured[index] = (args[0] if args else kwargs["hidden_states"], _first_tensor(out))

        return record

    inputs = dict(inputs)
    real = _real_tokens(inputs)
    if inputs.get("inputs_embeds") is not None:
        inputs["inputs_embeds"] = inputs["inputs_embeds"].detach().requires_grad_()
        leaf.append(inputs["inputs_embeds"])
        handles = []
    else:
        handles = [model.get_input_embeddings().register_forward_hook(embedded)]
    handles += [layer.register_forward_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)]
    seen_in_forward: dict[int, dict[str, torch.Tensor]] = {}

    def parameters_seen(module: nn.Module, args: tuple) -> None:
        seen_in_forward.setdefault(id(module), dict(module.named_parameters()))

    owners = {id(t.owner): t.owner for t in targets}.values()
    handles += [owner.register_forward_pre_hook(parameters_seen) for owner in owners]
    try:
        with probing(model), torch.enable_grad():
            gather_root(model)
            output = model.forward(**inputs)  # inside the step's own call: not through its hooks again (FSDP2's)
            loss = output["loss"] if isinstance(output, dict) else output[0]
            total = loss.float()
            for index in probed:
                out = captured[index][1]
                if index not in cotangents:
                    cotangents[index] = torch.randn(out.shape, generator=generator, dtype=torch.float64)
                cotangent = cotangents[index].to(out.device, out.dtype)
                axis = _token_axis(out, real)
                if axis is not None:  # padding's hidden states are not the model's output: hf_memo may zero them
                    shape = [1] * axis + list(real.shape) + [1] * (out.dim() - axis - 2)
                    cotangent = cotangent * real.reshape(shape).to(out)
                total = total + (cotangent * out).float().sum() / math.sqrt(out.numel())
            found = {id(o): seen_in_forward.get(id(o)) or dict(o.named_parameters()) for o in owners}
            named = [("the embeddings' output", t) for t in leaf[:1]]
            named += [(t.label, found[id(t.owner)][t.name]) for t in targets]
            gradients = torch.autograd.grad(total, [t for _, t in named], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    # kept on the host: the device holds no more than one pass's gradients (a layer's and the head's) at a time
    layers_seen = {
        i: tuple(t.cpu() for t in _real_rows(x.detach(), y.detach(), real)) for i, (x, y) in captured.items()
    }
    grads = {name: None if g is None else g.detach().cpu() for (name, _), g in zip(named, gradients)}
    return _Run(loss.detach().float().cpu(), layers_seen, grads)


def _real_tokens(inputs: dict[str, Any]) -> torch.Tensor | None:
    """``(b, P)`` bool: the probe's real tokens (``attention_mask`` 1), or ``None`` where every token is real."""
    mask = inputs.get("attention_mask")
    return None if mask is None or bool(mask.all()) else mask != 0


def _token_axis(y: torch.Tensor, real: torch.Tensor | None) -> int | None:
    """Where a layer's output ``y`` has the probe's ``(b, P)`` token axes: the first ``i`` with
    ``y.shape[i:i + 2] == (b, P)`` (0 for ``(b, P, H)``; 1 for Gemma-3n's stack of AltUp predictions
    ``(k, b, P, H)``), or ``None`` where every token is real or no such axes are found."""
    if real is None:
        return None
    return next((i for i in range(y.dim() - 1) if tuple(y.shape[i : i + 2]) == tuple(real.shape)), None)


def _real_rows(x: torch.Tensor, y: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input and output (``(b, P, H)``, or with other axes around ``(b, P)``) at the real tokens only
    ``(n, ...)``: padding's hidden states are no output of the model (hf_memo's per-sample attention gives padding
    queries no attention)."""
    axis = _token_axis(y, real)
    if axis is None:
        return x, y
    keep = real.to(y.device)

    def kept(t: torch.Tensor) -> torch.Tensor:
        return t.movedim((axis, axis + 1), (0, 1))[keep]

    return (kept(x) if x.shape == y.shape else x), kept(y)


def _relative(
    got: torch.Tensor | None, expected: torch.Tensor | None, scale: torch.Tensor | None = None, floor: float = 0.0
) -> float:
    """``max |got - expected| / max(max |scale|, floor)`` (``scale`` defaults to ``expected``) over the entries where
    ``expected`` is finite; infinite where only one of them is ``None`` or ``got`` is not finite there."""
    if got is None or expected is None:
        return 0.0 if got is None and expected is None else math.inf
    if got.shape != expected.shape:
        return math.inf
    if not expected.numel():
        return 0.0
    dtype = torch.promote_types(expected.dtype, torch.float32)  # fp64 where the model is, else fp32 (a head's size)
    difference = got.to(dtype) - expected.to(dtype)
    largest = torch.linalg.vector_norm(difference, math.inf)  # max |entry| in one pass
    if not torch.isfinite(largest):  # (rare) a non-finite entry: only those of ``expected`` are left out
        finite = torch.isfinite(expected)
        if not torch.isfinite(difference[finite]).all():
            return math.inf
        largest = difference.masked_fill_(~finite, 0).abs_().max()
    base = _finite_max(expected if scale is None else scale)
    return float(largest) / max(base, floor, _TINY)


def _differences(reference: _Run, patched: _Run, layers: list[nn.Module], tolerance: float) -> list[_Difference]:
    """Every compared quantity's relative difference, in the order a cause shows first: layer outputs bottom up,
    the loss, then the gradients. A gradient is measured against the larger of its own size and ``tolerance`` times
    the largest gradient entry of the probe: one that is zero but for rounding (a top-1 router's weights normalised
    to one) holds only the rounding of the terms that cancel in it."""
    differences = []
    for index, layer in enumerate(layers):
        name = f"decoder layer {index} ({type(layer).__name__})'s output"
        if index not in reference.layers or index not in patched.layers:
            if (index in reference.layers) != (index in patched.layers):
                differences.append(_Difference(name + " (run in one model only)", math.inf))
            continue
        x, expected = reference.layers[index]
        got = patched.layers[index][1]
        differences.append(
            _Difference(name, _relative(got, expected, expected - x if x.shape == expected.shape else None))
        )
    differences.append(_Difference("the loss", _relative(patched.loss, reference.loss)))
    largest = max((_finite_max(g) for g in reference.gradients.values() if g is not None), default=0.0)
    floor = tolerance * largest
    for key in [*reference.gradients, *(k for k in patched.gradients if k not in reference.gradients)]:
        got, expected = patched.gradients.get(key), reference.gradients.get(key)
        name = f"the gradient of {key}"
        if (got is None) != (expected is None):
            differences.append(_Difference(name + " (one model gives it none)", math.inf))
        elif got is not None:
            differences.append(_Difference(name, _relative(got, expected, floor=floor)))
    return differences


def _finite_max(tensor: torch.Tensor) -> float:
    """The largest finite ``|entry|`` of ``tensor`` (0 where none is)."""
    if not tensor.numel():
        return 0.0
    largest = float(torch.linalg.vector_norm(tensor, math.inf))  # one pass where every entry is finite
    if math.isfinite(largest):
        return largest
    values = tensor.abs().to(torch.float64)
    return float(torch.where(torch.isfinite(values), values, 0.0).max())


def _tolerance(model: PreTrainedModel) -> float:
    """The rounding allowed for the dtype ``model`` computes in: autocast's where it is on, else its parameters'."""
    parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = parameter.dtype if parameter is not None else torch.float32
    device = parameter.device.type if parameter is not None else "cpu"
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    return TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
