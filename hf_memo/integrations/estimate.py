"""``hf_memo.estimate`` and ``hf-memo estimate``: peak memory of a training step and the longest sequence that fits.

Every setup ("mode", see :mod:`hf_memo.integrations.setups`) is profiled on fake tensors, so any model
and any sequence length is estimated on a CPU in seconds, without its weights. Bytes the profile
finds on the host (offloaded tensors) count as host memory, everything else as device memory. The
memo mode runs the memory-policy solver on its profile (see :mod:`hf_memo.integrations.memo_estimate`):
its longest sequence is the longest for which some policy fits the device and the host. Step times
are FLOP counts at the ``gpu``'s peak, plus the copy time the memo policy cannot hide.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from hf_memo.integrations.memo_estimate import (
    DEFAULT_GPU,
    GPUS,
    Gpu,
    LayerFlops,
    MemoModel,
    gpu_of,
    head_seconds,
    model_flops,
    step_seconds,
)
from hf_memo.integrations.setups import (
    DEFAULT_MODES,
    DTYPES,
    LORA_RANK,
    MODES,
    POSITION_LIMITS,
    TRAINABLE,
    choice,
    config_of,
    memo_with_offload,
    parse,
    positive_int,
    with_lora,
)
from hf_memo.profiler.fake_model import FakeSession
from hf_memo.profiler.footprint import Footprint, StepProfiler
from hf_memo.profiler.plot import plot_timelines
from hf_memo.profiler.search import longest_fitting
from hf_memo.profiler.shapes import SHAPE_NAMES
from hf_memo.profiler.step import OPTIMIZERS
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.units import format_bytes, parse_bytes, parse_tokens

HELP = "Estimate peak GPU and host memory of a training step per mode, and the longest sequence that fits."


@dataclass(frozen=True)
class ModeEstimate:
    """One mode's result: the footprint at the requested length and the longest length that fits."""

    mode: str
    description: str
    footprint: Footprint
    fits: bool
    longest_seq_len: int | None
    longest_is_search_limit: bool = False
    policy: str | None = None  # memo: the memory policy at the requested length (layers per kind, where)
    step_seconds: float | None = None  # FLOP-based at the GPU's peak, plus exposed copies
    mfu: float | None = None  # model FLOPs / (step time x peak)

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["footprint"]["device"].pop("index")
        record["footprint"]["host"].pop("index")
        return record


@dataclass
class Estimate:
    """Per-mode memory estimates of one training setup (see :func:`estimate`)."""

    model: str
    layers: int
    seq_len: int
    batch_size: int
    dtype: str
    trainable: str
    optimizer: str
    gpu_memory: int
    host_memory: int | None
    modes: dict[str, ModeEstimate]
    gpu: str = DEFAULT_GPU
    traces: dict[str, AllocationTrace] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        record = {k: v for k, v in asdict(self).items() if k not in ("modes", "traces")}
        record["modes"] = {name: result.to_dict() for name, result in self.modes.items()}
        return record

    def _methods(self) -> list[str]:
        """One "Method:" line, or one per mode when modes were profiled differently."""
        methods = {name: result.footprint.method for name, result in self.modes.items()}
        if len(set(methods.values())) == 1:
            return [f"Method: {next(iter(methods.values()))}."]
        return [f"Method ({name}): {method}." for name, method in methods.items()]

    def table(self) -> str:
        """The side-by-side text table the command line prints."""
        names = list(self.modes)
        rows: list[tuple[str, list[str]]] = []
        for category in ("parameter", "gradient", "optimizer", "activation", "temporary", "buffer"):
            label = {"optimizer": "optimizer state", "temporary": "temporaries"}.get(category, category + "s")
            rows.append(
                (f"  {label}", [format_bytes(self.modes[n].footprint.device.by_category[category]) for n in names])
            )
        rows.append(("peak device memory", [format_bytes(self.modes[n].footprint.device.total) for n in names]))
        rows.append(("  reached in", [self.modes[n].footprint.device.phase for n in names]))
        rows.append(("peak host memory", [format_bytes(self.modes[n].footprint.host.total) for n in names]))
        budget = format_bytes(self.gpu_memory) + (
            f" + {format_bytes(self.host_memory)} host" if self.host_memory is not None else ""
        )
        rows.append((f"fits {budget}", ["yes" if self.modes[n].fits else "no" for n in names]))
        if any(self.modes[n].longest_seq_len is not None for n in names):
            rows.append(("longest sequence", [_longest(self.modes[n]) for n in names]))
        rows.append(("step time", [_seconds(self.modes[n].step_seconds) for n in names]))
        rows.append(("MFU", ["-" if self.modes[n].mfu is None else f"{self.modes[n].mfu:.0%}" for n in names]))
        label_width = max(len(label) for label, _ in rows) + 2
        width = 2 + max(len(cell) for cell in names + [v for _, values in rows for v in values])
        lines = [
            f"{self.model}: {self.layers} layers, {self.dtype}, batch {self.batch_size} x {self.seq_len:,} tokens, "
            f"{'full fine-tuning' if self.trainable == 'full' else f'LoRA (r={LORA_RANK}, PEFT default targets)'}, "
            f"optimizer {'AdamW (fused, states in the parameter dtype)' if self.optimizer == 'adamw' else 'none'}",
            f"GPU memory {format_bytes(self.gpu_memory)}"
            + (f", host memory {format_bytes(self.host_memory)}" if self.host_memory is not None else ""),
            *self._methods(),
            "",
            " " * label_width + "".join(n.rjust(width) for n in names),
        ]
        lines += [label.ljust(label_width) + "".join(v.rjust(width) for v in values) for label, values in rows]
        lines.append("")
        lines += [f"{n}: {self.modes[n].description}" for n in names]
        gpu = GPUS[self.gpu]
        lines.append(
            f"Step time: FLOPs at the {gpu.name}'s bf16 peak ({gpu.peak_flops / 1e12:.0f} TFLOP/s), plus copies to and "
            f"from the host at {gpu.host_bandwidth / 1e9:.0f} GB/s not hidden behind compute (--gpu)."
        )
        lines += [f"memo policy: {self.modes[n].policy}" for n in names if self.modes[n].policy]
        return "\n".join(lines)


def _seconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def _longest(result: ModeEstimate) -> str:
    if result.longest_seq_len is None:
        return "-"
    return ("≥ " if result.longest_is_search_limit else "") + f"{result.longest_seq_len:,}"


def estimate(
    model_or_config: str | PretrainedConfig | nn.Module,
    seq_len: int | str,
    gpu_memory: int | str = "80GiB",
    host_memory: int | str | None = None,
    batch_size: int = 1,
    trainable: str = "full",
    optimizer: str = "adamw",
    modes: Sequence[str] = DEFAULT_MODES,
    dtype: torch.dtype = torch.bfloat16,
    search: bool = True,
    keep_traces: bool = False,
    progress: bool = True,
    gpu: str = DEFAULT_GPU,
) -> Estimate:
    """Peak device memory by category, host memory and the longest sequence that fits, per mode.

    Args:
        model_or_config: a built-in name (``"llama-3-8b"``, ...), a path to a ``config.json``, a
            ``PretrainedConfig``, or a model (only its config is used; nothing is run on it).
        seq_len: tokens per sequence ``S`` (an int or ``"128k"``); batches are ``(batch_size, S)``.
        gpu_memory: device memory per GPU (``"80GiB"``, ``"80GB"`` or bytes).
        host_memory: host memory for offloaded tensors; ``None`` puts no limit on it.
        batch_size: sequences per step.
        trainable: ``"full"`` fine-tuning or ``"lora"`` (PEFT LoRA, r=8, PEFT's default targets).
        optimizer: ``"adamw"`` (fused AdamW, states in the parameter dtype) or ``"none"``.
        modes: names from :data:`MODES`.
        dtype: parameter dtype.
        search: also find the longest ``S`` (a multiple of 256) that fits ``gpu_memory`` (and ``host_memory``);
            for memo, the longest for which some memory policy fits.
        keep_traces: keep each mode's full-depth allocation trace at ``seq_len`` in ``Estimate.traces``
            (memo: with its smallest MEMO policy, every swapped layer's input and attention output on the host).
        progress: show a progress bar.
        gpu: the cost model's GPU for step times (``"h100"``, ``"h200"``, ``"a100"``; see
            :data:`~hf_memo.integrations.memo_estimate.GPUS`).
    """
    name, config = config_of(model_or_config)
    seq_len = parse_tokens(seq_len)
    gpu_bytes = parse_bytes(gpu_memory)
    host_bytes = None if host_memory is None else parse_bytes(host_memory)
    if gpu_bytes <= 0:
        raise ValueError(f"gpu_memory must be positive, got {gpu_memory!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    choice("trainable", trainable, TRAINABLE)
    choice("optimizer", optimizer, OPTIMIZERS)
    if not modes:
        raise ValueError(f"modes must name at least one of {', '.join(MODES)}")
    for mode in modes:
        choice("mode", mode, list(MODES))
    limit_field = POSITION_LIMITS.get(config.model_type)
    search_limit = getattr(config, limit_field) if limit_field else 1 << 24
    if seq_len > search_limit:
        raise ValueError(f"{name} has learned positions for at most {search_limit:,} tokens, got seq_len {seq_len:,}")

    spec, gpu = gpu_of(gpu), gpu.lower()
    allow_x_only = not getattr(config.get_text_config(), "attention_dropout", 0.0)
    bar = tqdm(desc="profiling", unit="step", disable=not progress, leave=False)
    results: dict[str, ModeEstimate] = {}
    traces: dict[str, AllocationTrace] = {}
    dtype_name = {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))
    try:
        for mode in modes:

            def profiler_of(configure: Callable[[nn.Module], None], mode: str = mode) -> StepProfiler:
                def prepare(model: nn.Module, session: FakeSession) -> nn.Module:
                    if trainable == "lora":
                        model = with_lora(model, session)
                    configure(model)
                    return model

                def on_profile(layers: int, tokens: int) -> None:
                    bar.set_postfix_str(f"{mode}, {layers} layers, S={tokens:,}")
                    bar.update()

                meta = {"model": name, "mode": mode, "dtype": dtype_name, "trainable": trainable}
                return StepProfiler(
                    config, prepare, dtype, batch_size, optimizer, on_profile, meta, MODES[mode].profile_layers
                )

            profiler = profiler_of(lambda model, mode=mode: MODES[mode].configure(model, host_bytes))
            if mode == "memo":
                results[mode] = memo_mode_estimate(
                    MemoModel(lambda f: profiler_of(memo_with_offload(f)), batch_size, spec, allow_x_only),
                    seq_len,
                    gpu_bytes,
                    host_bytes,
                    search,
                    search_limit,
                )
            else:
                results[mode] = profiled_mode_estimate(
                    mode, profiler, seq_len, gpu_bytes, host_bytes, search, search_limit, spec
                )
            if keep_traces:
                traces[mode] = profiler.trace(seq_len)
    finally:
        bar.close()
    layers = config.get_text_config().num_hidden_layers
    return Estimate(
        name,
        layers,
        seq_len,
        batch_size,
        dtype_name,
        trainable,
        optimizer,
        gpu_bytes,
        host_bytes,
        results,
        traces=traces,
        gpu=gpu,
    )


# -- command line --------------------------------------------------------------------------------------


def add_parser(parser: argparse.ArgumentParser) -> None:
    def error(message: str) -> None:  # one line, like every other bad input
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]
    parser.add_argument(
        "--model", required=True, help=f"built-in model ({', '.join(SHAPE_NAMES)}) or a path to a config.json"
    )
    parser.add_argument(
        "--seq-len",
        default="32k",
        help="tokens per sequence, e.g. 32768, 128k or 1M (default 32k; the search for the longest starts there)",
    )
    parser.add_argument("--gpu-memory", required=True, help="memory of one GPU, e.g. 80GiB or 80GB")
    parser.add_argument(
        "--host-memory",
        default=None,
        help="host memory for offloaded activations, e.g. 1TiB (default: this machine's, from psutil)",
    )
    parser.add_argument(
        "--gpu", default=DEFAULT_GPU, help=f"GPU of the step-time model: {', '.join(GPUS)} (default {DEFAULT_GPU})"
    )
    parser.add_argument("--batch", default="1", help="sequences per step (default 1)")
    parser.add_argument("--trainable", default="full", help="full (default) or lora")
    parser.add_argument("--optimizer", default="adamw", help="adamw (default) or none")
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, of: {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument("--dtype", default="bf16", help="parameter dtype: bf16 (default), fp16 or fp32")
    parser.add_argument("--no-search", action="store_true", help="skip the search for the longest sequence")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", default=None, help="write a memory timeline PNG of each mode here")
    parser.add_argument("--trace-dir", default=None, help="write each mode's allocation trace here as JSON lines")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        choice("--modes", mode, list(MODES))
    result = estimate(
        args.model,
        parse("--seq-len", parse_tokens, args.seq_len),
        gpu_memory=parse("--gpu-memory", parse_bytes, args.gpu_memory),
        host_memory=psutil.virtual_memory().total
        if args.host_memory is None
        else parse("--host-memory", parse_bytes, args.host_memory),
        batch_size=positive_int("--batch", args.batch),
        trainable=choice("--trainable", args.trainable, TRAINABLE),
        optimizer=choice("--optimizer", args.optimizer, OPTIMIZERS),
        modes=modes,
        dtype=DTYPES[choice("--dtype", args.dtype, list(DTYPES))],
        search=not args.no_search,
        keep_traces=bool(args.plot or args.trace_dir),
        gpu=choice("--gpu", args.gpu.lower(), list(GPUS)),
    )
    if args.trace_dir:
        folder = Path(args.trace_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for mode, trace in result.traces.items():
            trace.save(folder / f"{mode}.jsonl")
    if args.plot:
        shape = f"{result.layers} layers, {result.dtype}, batch {result.batch_size} x {result.seq_len:,} tokens"
        title = f"{result.model}, {shape}: device memory over one training step"
        plot_timelines(result.traces, args.plot, title, result.gpu_memory)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.table())
        if args.trace_dir:
            print(f"\nTraces: {', '.join(str(Path(args.trace_dir) / f'{m}.jsonl') for m in result.traces)}")
        if args.plot:
            print(f"Timeline plot: {args.plot}")
    return 0


def profiled_mode_estimate(
    mode: str,
    profiler: StepProfiler,
    seq_len: int,
    gpu_bytes: int,
    host_bytes: int | None,
    search: bool,
    search_limit: int,
    gpu: Gpu,
) -> ModeEstimate:
    """A mode whose memory is what its profile shows."""
    footprints: dict[int, Footprint] = {}

    def usage(tokens: int) -> float:
        if tokens not in footprints:
            footprints[tokens] = profiler.footprint(tokens)
        host = footprints[tokens].host.total
        device_share = footprints[tokens].device.total / gpu_bytes
        return device_share if host_bytes is None else max(device_share, host / max(host_bytes, 1))

    fits = usage(seq_len) <= 1
    longest = longest_fitting(usage, seq_len, limit=search_limit) if search else None
    model = profiler.model(profiler.profile_layers[0])
    flops, batch = LayerFlops.of(model), profiler.batch_size
    head = head_seconds(model, batch, seq_len, gpu)
    seconds = step_seconds(mode, flops, profiler.layers, head, batch, seq_len, gpu)
    useful = model_flops(flops, profiler.layers, head, batch, seq_len, gpu)
    return ModeEstimate(
        mode,
        MODES[mode].description,
        footprints[seq_len],
        fits,
        longest,
        longest is not None and longest >= search_limit - search_limit % 256,
        step_seconds=seconds,
        mfu=useful / (seconds * gpu.peak_flops),
    )


MEMO_DESCRIPTION = (
    "hf_memo.apply(recompute='memo'): MEMO executor under the memory policy its solver picks (per layer: keep "
    "X + attention or X only, on the host or the device, and alpha); memory from its profile and the policy"
)


def memo_mode_estimate(
    memo: MemoModel,
    seq_len: int,
    gpu_bytes: int,
    host_bytes: int | None,
    search: bool,
    search_limit: int,
) -> ModeEstimate:
    """The memo mode: the fastest policy that fits at ``seq_len``; the longest length some policy fits."""
    choice_ = memo.choose(seq_len, gpu_bytes, host_bytes)
    longest = None
    if search:
        longest = longest_fitting(lambda s: memo.smallest_usage(s, gpu_bytes, host_bytes), seq_len, limit=search_limit)
    footprint = Footprint(seq_len, choice_.device, choice_.host, memo.layers, memo.method)
    policy, seconds, mfu = choice_.policy, None, None
    if policy is not None:
        model, batch = memo.model, memo.batch_size
        head = head_seconds(model, batch, seq_len, memo.gpu)
        seconds = policy.predicted_step_seconds + head
        mfu = model_flops(memo.flops, memo.layers, head, batch, seq_len, memo.gpu) / (seconds * memo.gpu.peak_flops)
    return ModeEstimate(
        "memo",
        MEMO_DESCRIPTION,
        footprint,
        policy is not None,
        longest,
        longest is not None and longest >= search_limit - search_limit % 256,
        policy=policy.summary() if policy is not None else f"none fits: {choice_.shortfall}",
        step_seconds=seconds,
        mfu=mfu,
    )
