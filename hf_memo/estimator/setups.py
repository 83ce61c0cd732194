"""Training setups profiled on fake tensors: the modes, the model to profile, and shared argument checks.

Used by ``hf-memo estimate`` and ``hf-memo plan``. A mode is one entry of :data:`MODES`: a function that
configures the freshly built model (checkpointing, ``hf_memo.apply``, ...).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_memo.planner.policy import MemoryPolicy
from hf_memo.profiler.footprint import PROFILE_LAYERS
from hf_memo.profiler.shapes import SHAPE_NAMES, check_decoder_lm, load_config

if TYPE_CHECKING:  # PyTorch loads when a mode configures its first model: a cached answer needs it not
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from hf_memo.profiler.fake_model import FakeSession


# hf_memo's patches (and the model code behind them) load when a mode configures its first model: an answer read
# off cached closed forms needs none of them.
def apply(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """:func:`hf_memo.apply`, imported on first use."""
    from hf_memo.patches.apply import apply as patch

    patch(model, *args, **kwargs)


def memo_runtime(model: nn.Module) -> Any:
    """:func:`hf_memo.memo_runtime`, imported on first use."""
    from hf_memo.patches.apply import memo_runtime as runtime

    return runtime(model)


Chunks = tuple[int | str, int | str]  # (mlp_chunks, lm_head_chunks) settings of MemoConfig
AUTO_CHUNKS: Chunks = ("auto", "auto")


@dataclass(frozen=True)
class Mode:
    """A training setup: ``configure(model, host_memory)`` turns the bare model into the one trained.

    Modes that run the MLP and the LM head in mini-sequences name how they cut them (``chunking``: ``"tokens"``,
    the mini-sequence ops' rule over all ``B * S`` rows, or ``"memo"``, the memo executor's rule over each
    sequence's ``S`` positions) and take the chunk counts to profile with (``configure_chunked(model,
    host_memory, chunks)``).
    """

    description: str
    configure: Callable[[nn.Module, int | None], None]
    profile_layers: tuple[int, int] = PROFILE_LAYERS
    chunking: str | None = None
    configure_chunked: Callable[[nn.Module, int | None, Chunks], None] | None = None
    recomputes_layers: bool = False  # whether backward runs every decoder layer's forward again (step-time bound)


def _hf_checkpointing(model: nn.Module, host_memory: int | None) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _minseq(model: nn.Module, host_memory: int | None, chunks: Chunks = AUTO_CHUNKS) -> None:
    _hf_checkpointing(model, host_memory)
    apply(model, mlp_chunks=chunks[0], lm_head_chunks=chunks[1])


def _patched(recompute: str) -> Callable[[nn.Module, int | None, Chunks], None]:
    """``configure(model, host_memory, chunks)``: ``hf_memo.apply(model, recompute=recompute)`` with the given chunk
    settings and every other setting ``MemoConfig``'s default (the patched model's own mode, no Hugging Face
    checkpointing)."""

    def configure(model: nn.Module, host_memory: int | None, chunks: Chunks = AUTO_CHUNKS) -> None:
        apply(model, recompute=recompute, mlp_chunks=chunks[0], lm_head_chunks=chunks[1])

    return configure


UNLIMITED_HOST = 2**50


def _memo(model: nn.Module, host_memory: int | None, chunks: Chunks = AUTO_CHUNKS) -> None:
    # alpha = 0: the device peak hardly depends on alpha (offloaded tokens end up on the host, the others keep
    # nothing), and the host memory shown is memo's minimum: each swapped layer's input and attention output.
    limit = UNLIMITED_HOST if host_memory is None else host_memory
    apply(
        model,
        recompute="memo",
        offload_fraction=0.0,
        host_memory_limit=limit,
        mlp_chunks=chunks[0],
        lm_head_chunks=chunks[1],
    )


def memo_with_offload(
    fraction: float, chunks: Chunks = AUTO_CHUNKS, sequence_parallel: int = 1
) -> Callable[[nn.Module], None]:
    """Configure the memo executor with a fixed ``offload_fraction``, no host limit, the given chunk settings and
    sequence-parallel degree (what the estimator's memory policy profiles: the bytes a layer stashes at
    ``alpha = 0`` and ``alpha = 1``)."""

    def configure(model: nn.Module) -> None:
        apply(
            model,
            recompute="memo",
            offload_fraction=fraction,
            host_memory_limit=UNLIMITED_HOST,
            mlp_chunks=chunks[0],
            lm_head_chunks=chunks[1],
            sequence_parallel_size=sequence_parallel,
        )

    return configure


def memo_with_policy(
    policy: MemoryPolicy, chunks: Chunks = AUTO_CHUNKS, sequence_parallel: int = 1
) -> Callable[[nn.Module], None]:
    """Configure the memo executor to run ``policy`` (one :class:`~hf_memo.planner.policy.LayerPolicy` per decoder
    layer) with no host limit, the given chunk settings and sequence-parallel degree: what the estimator profiles
    to size a policy."""

    def configure(model: nn.Module) -> None:
        memo_with_offload(0.0, chunks, sequence_parallel)(model)
        memo_runtime(model).assume_policy(policy)

    return configure


def _patched_mode(recompute: str, description: str, recomputes_layers: bool) -> Mode:
    configure = _patched(recompute)
    return Mode(
        description,
        configure,
        chunking="tokens",
        configure_chunked=configure,
        recomputes_layers=recomputes_layers,
    )


# MemoConfig(recompute=...)'s modes by their own names, and the two baselines by what they are.
MODES: dict[str, Mode] = {
    "hf": Mode("plain Hugging Face", lambda model, host_memory: None),
    "hf-checkpointing": Mode(
        "Hugging Face gradient checkpointing (non-reentrant)", _hf_checkpointing, recomputes_layers=True
    ),
    "none": _patched_mode(
        "none",
        "hf_memo.apply(recompute='none'): mini-sequence MLP and LM head, every activation kept",
        recomputes_layers=False,
    ),
    "full": _patched_mode(
        "full",
        "hf_memo.apply(recompute='full'): each layer's input kept, the layer recomputed; mini-sequence MLP and LM head",
        recomputes_layers=True,
    ),
    "selective": _patched_mode(
        "selective",
        "hf_memo.apply(recompute='selective'): matmul and attention outputs kept, the cheap parts recomputed "
        "(not counted in the step-time bound); mini-sequence MLP and LM head",
        recomputes_layers=False,
    ),
    "memo": Mode(
        "hf_memo.apply(recompute='memo'): MEMO executor, layer inputs and attention outputs on the host",
        _memo,
        profile_layers=(4, 5),  # the first depth with both rounding buffers and two device-resident layers
        chunking="memo",
        configure_chunked=_memo,
    ),
    # Deprecated (see DEPRECATED_MODES): the mode the estimator called "minseq", kept so that its answers stay.
    "minseq": Mode(
        "hf_memo.apply (mini-sequence MLP and LM head, default MemoConfig) + HF checkpointing",
        _minseq,
        chunking="tokens",
        configure_chunked=_minseq,
        recomputes_layers=True,
    ),
}
DEFAULT_MODES = ("hf", "hf-checkpointing", "full", "memo")
# The estimator's old mode names: old name -> (the mode it is now, what to say instead). "vanilla" is "hf" under
# another name; "minseq" stays a mode of its own (hf_memo with recompute="none" under Hugging Face's checkpointing,
# not one of MemoConfig's modes), named only to be warned about.
DEPRECATED_MODES: dict[str, tuple[str, str]] = {
    "vanilla": ("hf", "say hf (plain Hugging Face)"),
    "minseq": (
        "minseq",
        "it is hf_memo.apply(recompute='none') under Hugging Face checkpointing; say full (hf_memo's own recompute "
        "of each layer), selective or none",
    ),
}
CURRENT_MODES = tuple(name for name in MODES if name not in DEPRECATED_MODES)  # what --modes offers (built in)


def resolve_modes(names: Sequence[str], what: str = "mode") -> tuple[list[str], list[str]]:
    """``names`` in the current vocabulary (old names mapped, each once, in the order given) and a deprecation note
    per old name; ``ValueError`` naming ``what`` for a name that is no mode."""
    modes: list[str] = []
    notes: list[str] = []
    for name in names:
        if name in DEPRECATED_MODES:
            mode, instead = DEPRECATED_MODES[name]
            notes.append(f"{what} {name!r} is deprecated: {instead}")
        else:
            mode = choice(what, name, [mode for mode in MODES if mode not in DEPRECATED_MODES])
        if mode not in modes:
            modes.append(mode)
    return modes, notes


TRAINABLE = ("full", "lora")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype's names -> PyTorch's


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The PyTorch dtype of a name of :data:`DTYPES` (a PyTorch dtype is returned as it is)."""
    if not isinstance(dtype, str):
        return dtype
    import torch

    return getattr(torch, DTYPES[choice("dtype", dtype, list(DTYPES))])


def dtype_name(dtype: str | torch.dtype) -> str:
    """The name in :data:`DTYPES` of ``dtype`` (a name, checked, or a PyTorch dtype; ``str(dtype)`` for another)."""
    if isinstance(dtype, str):
        return choice("dtype", dtype, list(DTYPES))
    return next((name for name, attr in DTYPES.items() if str(dtype) == f"torch.{attr}"), str(dtype))


LORA_RANK = 8
# Families whose learned position table caps the sequence length: model_type -> config field.
POSITION_LIMITS = {"gpt2": "n_positions"}


def config_of(model_or_config: str | PretrainedConfig | nn.Module) -> tuple[str, PretrainedConfig]:
    """``(name, config)`` of a built-in name, a ``config.json`` path, a Hub id, a config or a model (its causal LM's
    config); ``ValueError`` unless it is a decoder-only causal LM."""
    from torch import nn
    from transformers import PretrainedConfig

    if isinstance(model_or_config, str):
        return model_or_config, load_config(model_or_config)
    if isinstance(model_or_config, PretrainedConfig):
        config = model_or_config
    elif isinstance(model_or_config, nn.Module):
        from hf_memo.patches.apply import causal_lm_of

        config = causal_lm_of(model_or_config).config
    else:
        raise ValueError(
            f"model_or_config must be a built-in model name ({', '.join(SHAPE_NAMES)}), a path to a config.json, "
            f"a Hugging Face Hub id, a PretrainedConfig or a model, got {type(model_or_config).__name__}"
        )
    name = getattr(config, "_name_or_path", "") or config.model_type
    return name, check_decoder_lm(config, name)


@dataclass(frozen=True)
class Lora:
    """What PEFT LoRA trains: rank-``rank`` adapters on the modules named ``targets`` (``None``: PEFT's default
    targets for the model type) and the modules named ``modules`` trained in full beside them (PEFT's
    ``modules_to_save``: a trainable copy of each; ``"norm"`` names every module whose name ends so)."""

    rank: int = LORA_RANK
    targets: tuple[str, ...] | None = None
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora_rank must be an int >= 1, got {self.rank!r}")
        for field, names in (("lora_targets", self.targets or ()), ("trainable_modules", self.modules)):
            if any(not isinstance(name, str) or not name for name in names):
                raise ValueError(f"{field} must be module names, got {names!r}")
        if self.targets == ():
            raise ValueError("lora_targets must name at least one module (or be None: PEFT's default targets)")

    def resolved(self, model_type: str) -> Lora:
        """This setup with PEFT's default targets for ``model_type`` filled in (unchanged if PEFT has none)."""
        if self.targets is not None:
            return self
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        targets = defaults.get(model_type)
        return self if targets is None else Lora(self.rank, tuple(targets), self.modules)

    def describe(self) -> str:
        """``"LoRA r=8 on q_proj, v_proj; embed_tokens, norm trained in full"``."""
        targets = "PEFT's default targets" if self.targets is None else ", ".join(self.targets)
        full = f"; {', '.join(self.modules)} trained in full" if self.modules else ""
        return f"LoRA r={self.rank} on {targets}{full}"


def with_lora(model: nn.Module, session: FakeSession, lora: Lora | None = None) -> nn.Module:
    """``model`` wrapped by PEFT LoRA as ``lora`` says (default: rank 8 on PEFT's default targets for its family)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("trainable='lora' needs the peft package (pip install peft)") from None
    lora = lora or Lora()
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=2 * lora.rank,
        target_modules=None if lora.targets is None else list(lora.targets),
        modules_to_save=list(lora.modules) or None,
        task_type="CAUSAL_LM",
    )
    with session.converting_modules(), warnings.catch_warnings():
        # PEFT reads a property this Transformers deprecates: nothing the user of the estimate can act on.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        # Copying a fake module for modules_to_save reads its fake data pointer: harmless here.
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor", UserWarning)
        try:
            peft_model = get_peft_model(model, config)
        except ValueError as error:
            raise ValueError(f"PEFT cannot add LoRA to {type(model).__name__}: {error}") from None
    _check_modules_found(peft_model, lora.modules, type(model).__name__)
    return peft_model


def _check_modules_found(model: nn.Module, modules: Sequence[str], model_name: str) -> None:
    """``ValueError`` for a name of ``modules`` that made no trainable copy (PEFT ignores such names silently)."""
    from peft.utils.other import ModulesToSaveWrapper

    copied = [name for name, module in model.named_modules() if isinstance(module, ModulesToSaveWrapper)]
    missing = [key for key in modules if not any(name.endswith(key) for name in copied)]
    if missing:
        raise ValueError(f"trainable_modules {', '.join(missing)}: no module of {model_name} has such a name")


def choice(name: str, value: Any, accepted: Sequence[str]) -> Any:
    if value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(accepted)}, got {value!r}")
    return value


def positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {text!r}")
    return value


def parse(name: str, parser: Callable[[str], int], text: str) -> int:
    try:
        return parser(text)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
