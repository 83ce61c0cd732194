"""The contenders: one registry entry each, and whether one can run here."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

CHECKPOINTING = (None, "recompute", "offload")
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# Expandable segments: what long-context recipes (DeepSpeed ALST, torchtitan) train with, and what keeps
# fragmentation from deciding which length fits. Every contender gets it unless its entry says otherwise.
DEFAULT_ALLOC_CONF = "expandable_segments:True"
PATCHES = (None, "liger-flce", "deepspeed-tiled")


@dataclass(frozen=True)
class Contender:
    """How one contender changes the model before training.

    Attributes:
        name: registry key, used in results and on the command line.
        description: one line for tables.
        checkpointing: Hugging Face activation checkpointing of every decoder layer: ``None``,
            ``"recompute"`` (``activation_checkpointing_enable()``) or ``"offload"`` (the same with its
            checkpoints in pinned host memory, ``offload=True``).
        patch: a third-party patch: ``None``, ``"liger-flce"`` (Liger-Kernel fused linear
            cross-entropy) or ``"deepspeed-tiled"`` (DeepSpeed ``TiledMLP`` + ``TiledFusedLogitsLoss``).
        memo: ``MemoConfig`` keyword arguments for ``hf_memo.apply``, or ``None`` to leave hf_memo out.
            A config that ``MemoConfig`` refuses marks the contender as skipped, with its error.
        requires: modules that must be importable.
        needs_cuda: runs only on a CUDA device (Triton kernels).
        cuda_alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` of its worker processes, set explicitly (the shell's
            value is never inherited) and recorded with every row; ``""`` is PyTorch's default allocator.
    """

    name: str
    description: str
    checkpointing: str | None = None
    patch: str | None = None
    memo: dict[str, Any] | None = None
    requires: tuple[str, ...] = ()
    needs_cuda: bool = False
    cuda_alloc_conf: str = DEFAULT_ALLOC_CONF

    def __post_init__(self) -> None:
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"Contender.checkpointing must be one of {CHECKPOINTING}, got {self.checkpointing!r}")
        if self.patch not in PATCHES:
            raise ValueError(f"Contender.patch must be one of {PATCHES}, got {self.patch!r}")

    @property
    def is_hf_memo(self) -> bool:
        return self.memo is not None


_LIGER = dict(patch="liger-flce", requires=("liger_kernel", "triton"), needs_cuda=True)
_DEEPSPEED = dict(patch="deepspeed-tiled", requires=("deepspeed",))

CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("hf", "Hugging Face, no memory savings"),
        Contender("hf+ckpt", "Hugging Face activation checkpointing", checkpointing="recompute"),
        Contender(
            "hf+ckpt+offload", "Hugging Face checkpointing, checkpoints in pinned host memory", checkpointing="offload"
        ),
        Contender("hf+liger-flce", "Liger-Kernel fused linear cross-entropy", **_LIGER),
        Contender(
            "hf+ckpt+liger-flce",
            "Liger-Kernel fused linear cross-entropy + HF checkpointing",
            checkpointing="recompute",
            **_LIGER,
        ),
        Contender(
            "ds-tiled+ckpt",
            "DeepSpeed TiledMLP + TiledFusedLogitsLoss + HF checkpointing",
            checkpointing="recompute",
            **_DEEPSPEED,
        ),
        Contender(
            "ds-tiled+ckpt+offload",
            "ALST on one GPU: DeepSpeed tiled MLP and loss + HF checkpointing with host offload",
            checkpointing="offload",
            **_DEEPSPEED,
        ),
        Contender("minseq", "hf_memo mini-sequence MLP and LM head", memo={}),
        Contender("minseq+ckpt", "hf_memo mini-sequence + HF checkpointing", checkpointing="recompute", memo={}),
        Contender(
            "minseq+ckpt+offload",
            "hf_memo mini-sequence + HF checkpointing with host offload",
            checkpointing="offload",
            memo={},
        ),
        Contender("selective", "hf_memo mini-sequence + selective recomputation", memo={"recompute": "selective"}),
        Contender(
            "memo-auto",
            "hf_memo MEMO token-wise offload/recompute, alpha solved",
            memo={"recompute": "memo", "offload_fraction": "auto"},
        ),
        Contender(
            "memo+planner",
            "hf_memo MEMO, alpha solved, memory planned (CP-SAT)",
            memo={"recompute": "memo", "offload_fraction": "auto", "planner": "cpsat"},
        ),
    )
}


def contender(name: str) -> Contender:
    """The contender called ``name``; ``ValueError`` lists the known ones."""
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; known contenders: {', '.join(CONTENDERS)}")
    return CONTENDERS[name]


def memo_config_kwargs(entry: Contender, dry_run: bool, dry_run_scale: int) -> dict[str, Any]:
    """The entry's ``MemoConfig`` arguments; a dry run shrinks ``min_chunk_tokens`` with the sequence lengths."""
    kwargs = dict(entry.memo or {})
    if dry_run:
        from hf_memo import MemoConfig

        kwargs.setdefault("min_chunk_tokens", max(1, MemoConfig().min_chunk_tokens // dry_run_scale))
    return kwargs


def unavailable_reason(entry: Contender, dry_run: bool) -> str | None:
    """Why ``entry`` cannot run here (a missing package, no CUDA in a dry run), or ``None``.

    Cheap: nothing optional is imported, and CUDA is not initialised.
    """
    missing = [module for module in entry.requires if importlib.util.find_spec(module) is None]
    if missing:
        return f"{', '.join(missing)} not importable"
    if entry.needs_cuda and dry_run:
        return "needs a CUDA device (Triton kernels); the dry run is CPU only"
    return None
