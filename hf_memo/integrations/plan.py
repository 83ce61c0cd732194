"""``hf-memo plan``: the bi-level memory plan of one training step, profiled on fake tensors or read from a trace.

The step is profiled the way ``hf-memo estimate`` profiles it (same modes, same model loading), but
at full depth: the planner places every tensor of the step, so a 32-layer model is traced with all
32 layers (on fake tensors that takes seconds, whatever the sequence length). The plan's peak is
printed beside the lower bound (the most bytes ever live) with the solve time and proven optimality
of each level, the arena for hf_memo's own buffers, and what a replay of PyTorch's caching allocator
reserves for the same step without the plan and with it.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from hf_memo.estimator.setups import (
    CURRENT_MODES,
    DTYPES,
    MODES,
    POSITION_LIMITS,
    TRAINABLE,
    choice,
    config_of,
    dtype_name,
    parse,
    positive_int,
    resolve_modes,
    torch_dtype,
    with_lora,
)
from hf_memo.planner.bilevel import plan_memory
from hf_memo.planner.caching_allocator import AllocatorReplay, replay, replay_with_arena
from hf_memo.planner.dsa import SOLVERS
from hf_memo.planner.lifetimes import Trace
from hf_memo.planner.plan import MemoryPlan
from hf_memo.profiler.fake_model import FakeSession
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.shapes import SHAPE_NAMES
from hf_memo.profiler.step import OPTIMIZERS
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.units import format_bytes, parse_bytes, parse_tokens

DEFAULT_MODE = "memo"


def profile_step(
    model_or_config: str | PretrainedConfig | nn.Module,
    seq_len: int | str,
    batch_size: int = 1,
    mode: str = DEFAULT_MODE,
    trainable: str = "full",
    optimizer: str = "adamw",
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = False,
) -> AllocationTrace:
    """The allocation trace of one whole training step on ``(batch_size, seq_len)`` tokens, every layer profiled.

    Args:
        model_or_config: a built-in name (``"llama-3-8b"``, ...), a path to a ``config.json``, a
            ``PretrainedConfig``, or a model (only its config is used).
        seq_len: tokens per sequence ``S`` (an int or ``"128k"``).
        mode: a mode of ``hf-memo estimate`` (:data:`hf_memo.integrations.estimate.MODES`).
        trainable, optimizer, dtype: as for :func:`hf_memo.estimate`.
        progress: show a progress bar.
    """
    name, config = config_of(model_or_config)
    seq_len = parse_tokens(seq_len)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    (mode,), notes = resolve_modes([mode])
    for note in notes:
        warnings.warn(note, FutureWarning, stacklevel=2)
    choice("trainable", trainable, TRAINABLE)
    choice("optimizer", optimizer, OPTIMIZERS)
    limit_field = POSITION_LIMITS.get(config.model_type)
    if limit_field and seq_len > getattr(config, limit_field):
        limit = getattr(config, limit_field)
        raise ValueError(f"{name} has learned positions for at most {limit:,} tokens, got seq_len {seq_len:,}")

    def prepare(model: nn.Module, session: FakeSession) -> nn.Module:
        if trainable == "lora":
            model = with_lora(model, session)
        MODES[mode].configure(model, None)
        return model

    meta = {"model": name, "mode": mode, "dtype": dtype_name(dtype), "trainable": trainable}
    profiler = StepProfiler(config, prepare, dtype, batch_size, optimizer, meta=meta)
    with tqdm(total=1, desc="profiling", unit="step", leave=False, disable=not progress) as bar:
        bar.set_postfix_str(f"{name}, {mode}, all {profiler.layers} layers, S={seq_len:,}")
        trace = profiler.trace(seq_len)
        bar.update()
    return trace


@dataclass(frozen=True)
class AllocatorComparison:
    """The caching allocator's replay of one step without the plan and with hf_memo's buffers in the arena."""

    without_plan: AllocatorReplay
    with_arena: AllocatorReplay

    @classmethod
    def of(cls, trace: AllocationTrace, plan: MemoryPlan) -> AllocatorComparison:
        device = Trace.from_allocations(trace)
        return cls(replay(device), replay_with_arena(device, plan.arena_size))

    def to_dict(self) -> dict[str, Any]:
        return {"without_plan": self.without_plan.summary(), "with_arena": self.with_arena.summary()}


def summary(trace: AllocationTrace, plan: MemoryPlan, allocator: AllocatorComparison, profile_seconds: float) -> str:
    """The text ``hf-memo plan`` prints: the step, the plan's levels, the arena, the allocator beside the plan."""
    meta = trace.meta
    lines = []
    if "seq_len" in meta:
        lines.append(
            f"{meta.get('model', '?')}: {meta.get('layers', '?')} layers, {meta.get('dtype', '?')}, batch "
            f"{meta.get('batch_size', '?')} x {meta['seq_len']:,} tokens, mode {meta.get('mode', '?')}, "
            f"{meta.get('trainable', 'full')} fine-tuning, optimizer {meta.get('optimizer', '?')}"
        )
    how = f"profiled on fake tensors in {profile_seconds:.1f} s" if profile_seconds else "read from a file"
    lines.append(f"Trace: {len(trace.events):,} events ({how})")
    lines.append(plan.summary())
    if plan.arena_offsets:
        lines.append(f"Arena for hf_memo's own buffers ({format_bytes(plan.arena_size)}):")
        for name, offset in sorted(plan.arena_offsets.items(), key=lambda item: (item[1], item[0])):
            lines.append(f"  {name}: {format_bytes(plan.arena_sizes[name])} at offset {format_bytes(offset)}")
    requested = allocator.without_plan.peak_requested
    lines.append("Caching allocator (simulated replay of the same step), reserved at peak:")
    lines.append(f"  without a plan: {_reserved(allocator.without_plan)}")
    if plan.arena_offsets:
        unused = "" if plan.arena_used else " (more: the runtime would not use the arena, see the warning)"
        lines.append(f"  hf_memo's buffers in the arena: {_reserved(allocator.with_arena)}{unused}")
    ratio = plan.peak / requested if requested else 1.0
    above = plan.peak > allocator.without_plan.peak_reserved
    note = " (more than the caching allocator; the runtime places only hf_memo's buffers)" if above else ""
    lines.append(f"  every tensor at its planned offset: {format_bytes(plan.peak)} (x{ratio:.3f} requested){note}")
    return "\n".join(lines)


def _reserved(run: AllocatorReplay) -> str:
    return (
        f"{format_bytes(run.peak_reserved)} for {format_bytes(run.peak_requested)} requested "
        f"(x{run.reserved_over_requested:.3f}), {run.segment_allocations} device segments"
    )


# -- command line --------------------------------------------------------------------------------------


def add_parser(parser: argparse.ArgumentParser) -> None:
    def error(message: str) -> None:  # one line, like every other bad input
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]
    parser.add_argument(
        "--model",
        help=f"built-in model ({', '.join(SHAPE_NAMES)}), a path to a config.json, or a Hugging Face Hub id such as "
        "meta-llama/Meta-Llama-3-8B (from the local cache; the Hub unless HF_HUB_OFFLINE=1)",
    )
    parser.add_argument("--seq-len", help="tokens per sequence, e.g. 32768, 128k or 1M")
    parser.add_argument("--batch", default="1", help="sequences per step (default 1)")
    parser.add_argument(
        "--mode", default=DEFAULT_MODE, help=f"one of {', '.join(CURRENT_MODES)} (default {DEFAULT_MODE})"
    )
    parser.add_argument("--trainable", default="full", help="full (default) or lora")
    parser.add_argument("--optimizer", default="adamw", help="adamw (default) or none")
    parser.add_argument("--dtype", default="bf16", help="parameter dtype: bf16 (default), fp16 or fp32")
    parser.add_argument("--solver", default="cpsat", help=f"DSA solver: {', '.join(SOLVERS)} (default cpsat)")
    parser.add_argument("--time-limit", default="10", help="seconds per DSA problem (default 10)")
    parser.add_argument(
        "--alignment",
        default="512B",
        help="bytes every size is rounded up to (default 512B); coarser (e.g. 1MiB) is easier to prove optimal",
    )
    parser.add_argument("--trace", default=None, help="plan this trace file (JSON lines) instead of profiling")
    parser.add_argument("--out", default=None, help="write the plan here as JSON")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"--time-limit must be a number of seconds > 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    solver = choice("--solver", args.solver, SOLVERS)
    time_limit = _seconds(args.time_limit)
    alignment = parse("--alignment", parse_bytes, args.alignment)
    if alignment < 1:
        raise ValueError(f"--alignment must be at least 1 byte, got {args.alignment!r}")
    began = time.perf_counter()
    if args.trace is not None:
        if args.model is not None or args.seq_len is not None:
            raise ValueError("--trace plans a saved trace: give either --trace or --model with --seq-len")
        trace = AllocationTrace.load(args.trace)
        profile_seconds = 0.0
    else:
        if args.model is None or args.seq_len is None:
            raise ValueError("give --model and --seq-len (or --trace with a saved trace)")
        seq_len = parse("--seq-len", parse_tokens, args.seq_len)
        batch_size = positive_int("--batch", args.batch)
        (mode,), notes = resolve_modes([args.mode], "--mode")
        for note in notes:
            print(f"hf-memo plan: warning: {note}", file=sys.stderr)
        trainable = choice("--trainable", args.trainable, TRAINABLE)
        optimizer = choice("--optimizer", args.optimizer, OPTIMIZERS)
        dtype = torch_dtype(choice("--dtype", args.dtype, list(DTYPES)))
        trace = profile_step(args.model, seq_len, batch_size, mode, trainable, optimizer, dtype, progress=True)
        profile_seconds = time.perf_counter() - began
    plan = plan_memory(trace, solver=solver, time_limit=time_limit, alignment=alignment)
    print(summary(trace, plan, AllocatorComparison.of(trace, plan), profile_seconds))
    if args.out:
        plan.save(args.out)
        print(f"Plan saved to {args.out}")
    return 0
