"""``hf-memo estimate``: the command line of :func:`hf_memo.estimator.estimate.estimate` (its flags, the
cluster and memory they describe, the table or JSON it prints, the traces and plots it writes)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import psutil

from hf_memo.estimator.cluster import (
    DEVICE_RESERVE,
    HOST_RESERVE_NODE,
    HOST_RESERVE_PER_RANK,
    PINNABLE_FRACTION,
    Cluster,
    DeepSpeedConfig,
    GiB,
)
from hf_memo.estimator.estimate import estimate
from hf_memo.estimator.fit_cache import CACHE_ENV, cache_dir
from hf_memo.estimator.report import HOST_FROM_FLAG, HOST_FROM_THIS_MACHINE, this_machine_warning
from hf_memo.estimator.setups import (
    CURRENT_MODES,
    DEFAULT_MODES,
    DTYPES,
    LORA_RANK,
    TRAINABLE,
    choice,
    parse,
    positive_int,
    resolve_modes,
)
from hf_memo.estimator.time_model import DEFAULT_GPU, GPUS
from hf_memo.profiler.plot import plot_timelines
from hf_memo.profiler.shapes import SHAPE_NAMES
from hf_memo.profiler.step import OPTIMIZERS
from hf_memo.units import format_bytes, parse_bytes, parse_tokens

# -- command line --------------------------------------------------------------------------------------


def add_parser(parser: argparse.ArgumentParser) -> None:
    def error(message: str) -> None:  # one line, like every other bad input
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]
    parser.add_argument(
        "--model",
        required=True,
        help=f"built-in model ({', '.join(SHAPE_NAMES)}), a path to a config.json (or its folder), or a Hugging "
        "Face Hub id such as meta-llama/Meta-Llama-3-8B (from the local cache; the Hub unless HF_HUB_OFFLINE=1)",
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
        help="host memory per node of the training machine for offloaded tensors, e.g. 1TiB (default: THIS "
        "machine's RAM, with a warning)",
    )
    parser.add_argument(
        "--reserve",
        default=f"{DEVICE_RESERVE // GiB}GiB",
        help="memory of each GPU the step may not use: CUDA context and cuBLAS workspace (~0.6 GiB), NCCL "
        f"buffers (~1 GiB), allocator fragmentation (~1.4 GiB) (default {DEVICE_RESERVE // GiB}GiB)",
    )
    parser.add_argument(
        "--host-reserve",
        default=None,
        help="host memory per node the ranks may not use: the OS and the processes (default "
        f"{HOST_RESERVE_NODE // GiB}GiB + {HOST_RESERVE_PER_RANK // GiB}GiB per GPU of the node)",
    )
    parser.add_argument(
        "--pinned-memory",
        default=None,
        help="host memory per node that may be pinned (default: "
        f"{PINNABLE_FRACTION:.0%}% of what the host reserve leaves)",  # argparse reads %%: a literal %
    )
    parser.add_argument(
        "--gpu", default=DEFAULT_GPU, help=f"GPU of the step-time bound: {', '.join(GPUS)} (default {DEFAULT_GPU})"
    )
    parser.add_argument("--batch", default="1", help="sequences per step (default 1)")
    parser.add_argument("--trainable", default="full", help="full (default) or lora")
    parser.add_argument("--lora-rank", default=None, help=f"rank of the LoRA adapters (default {LORA_RANK})")
    parser.add_argument(
        "--lora-targets",
        default=None,
        help="modules LoRA adapts, comma-separated, e.g. q_proj,k_proj,v_proj,o_proj (default: PEFT's default "
        "targets for the model type; q_proj,v_proj for Llama)",
    )
    parser.add_argument(
        "--trainable-modules",
        default=None,
        help="modules trained in full beside the LoRA adapters (PEFT's modules_to_save), comma-separated, e.g. "
        "embed_tokens,norm (default none)",
    )
    parser.add_argument("--optimizer", default="adamw", help="adamw (default) or none")
    parser.add_argument("--num-gpus", default="1", help="GPUs of the job (default 1)")
    parser.add_argument("--gpus-per-node", default="8", help="GPUs sharing one node's host memory (default 8)")
    parser.add_argument(
        "--sequence-parallel", default="1", help="Ulysses sequence-parallel degree K, dividing --num-gpus (default 1)"
    )
    parser.add_argument("--zero", default="0", help="ZeRO stage: 0 (default), 1, 2 or 3")
    parser.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="DeepSpeed offload_optimizer: master weights, fp32 gradients and AdamW moments on the host",
    )
    parser.add_argument(
        "--pure-bf16",
        action="store_true",
        help="DeepSpeed with bf16 master weights, gradients and AdamW moments (bf16_master_weights_and_grads, "
        "bf16_optimizer_states); default: fp32 ones (bf16 mixed precision)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, of: {', '.join(CURRENT_MODES)} (default: {','.join(DEFAULT_MODES)}); none, full, "
        "selective and memo are MemoConfig(recompute=...)'s modes, hf and hf-checkpointing plain Hugging Face without "
        "and with its gradient checkpointing; the old names vanilla (hf) and minseq still work, with a deprecation "
        "note",
    )
    parser.add_argument("--dtype", default="bf16", help="parameter dtype: bf16 (default), fp16 or fp32")
    parser.add_argument(
        "--jobs",
        default=None,
        help="processes that profile side by side (default: one per CPU this process may use, at most 8)",
    )
    parser.add_argument("--no-search", action="store_true", help="skip the search for the longest sequence")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="fit every closed form again instead of reading (and writing) the on-disk cache of fits "
        f"(${CACHE_ENV}, default {cache_dir()}) or reading the fits hf_memo ships; the answer is the same",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", default=None, help="write a memory timeline PNG of each mode here")
    parser.add_argument("--trace-dir", default=None, help="write each mode's allocation trace here as JSON lines")


def cluster_of(args: argparse.Namespace) -> Cluster:
    """The :class:`Cluster` the command line's flags describe; errors name the flag and its accepted values."""
    num_gpus = positive_int("--num-gpus", args.num_gpus)
    per_node = positive_int("--gpus-per-node", args.gpus_per_node)
    sp = positive_int("--sequence-parallel", args.sequence_parallel)
    if num_gpus % sp:
        raise ValueError(f"--sequence-parallel must divide --num-gpus ({num_gpus}), got {args.sequence_parallel!r}")
    zero = int(choice("--zero", args.zero, ["0", "1", "2", "3"]))
    if zero == 0 and (args.offload_optimizer or args.pure_bf16):
        raise ValueError("--offload-optimizer and --pure-bf16 are DeepSpeed ZeRO settings: they need --zero 1, 2 or 3")
    return Cluster(num_gpus, sp, zero, args.offload_optimizer, per_node, DeepSpeedConfig(pure_bf16=args.pure_bf16))


def memory_of(args: argparse.Namespace, cluster: Cluster) -> dict[str, int]:
    """The command line's memory sizes (``estimate``'s keyword arguments), its defaults filled in; errors name
    the flags."""
    gpu = parse("--gpu-memory", parse_bytes, args.gpu_memory)
    host = (
        psutil.virtual_memory().total
        if args.host_memory is None
        else parse("--host-memory", parse_bytes, args.host_memory)
    )
    reserve = parse("--reserve", parse_bytes, args.reserve)
    default_host_reserve = HOST_RESERVE_NODE + HOST_RESERVE_PER_RANK * cluster.ranks_per_node
    host_reserve = (
        default_host_reserve if args.host_reserve is None else parse("--host-reserve", parse_bytes, args.host_reserve)
    )
    if reserve >= gpu:
        raise ValueError(f"--reserve ({format_bytes(reserve)}) must be less than --gpu-memory ({format_bytes(gpu)})")
    if host_reserve >= host:
        raise ValueError(
            f"--host-reserve ({format_bytes(host_reserve)}) must be less than --host-memory ({format_bytes(host)})"
        )
    pinned = (
        int(PINNABLE_FRACTION * (host - host_reserve))
        if args.pinned_memory is None
        else parse("--pinned-memory", parse_bytes, args.pinned_memory)
    )
    return {
        "gpu_memory": gpu,
        "host_memory": host,
        "pinned_memory": pinned,
        "reserve": reserve,
        "host_reserve": host_reserve,
    }


def lora_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's LoRA settings (``estimate``'s keyword arguments); errors name the flags."""
    given = [
        flag
        for flag, value in (
            ("--lora-rank", args.lora_rank),
            ("--lora-targets", args.lora_targets),
            ("--trainable-modules", args.trainable_modules),
        )
        if value is not None
    ]
    if given and args.trainable != "lora":
        raise ValueError(f"{', '.join(given)}: only with --trainable lora")
    if args.lora_targets is not None and not args.lora_targets.strip(","):
        raise ValueError("--lora-targets must name at least one module, e.g. q_proj,v_proj")
    return {
        "lora_rank": None if args.lora_rank is None else positive_int("--lora-rank", args.lora_rank),
        "lora_targets": args.lora_targets,
        "trainable_modules": args.trainable_modules,
    }


def run(args: argparse.Namespace) -> int:
    modes, notes = resolve_modes([m.strip() for m in args.modes.split(",") if m.strip()], "--modes")
    if not modes:
        raise ValueError(f"--modes must name at least one of {', '.join(CURRENT_MODES)}, got {args.modes!r}")
    for note in notes:
        print(f"hf-memo estimate: warning: {note}", file=sys.stderr)
    cluster = cluster_of(args)
    with warnings.catch_warnings():  # each deprecated name was said above, once
        warnings.filterwarnings("ignore", "mode .* is deprecated", FutureWarning)
        result = estimate(
            args.model,
            parse("--seq-len", parse_tokens, args.seq_len),
            batch_size=positive_int("--batch", args.batch),
            trainable=choice("--trainable", args.trainable, TRAINABLE),
            **lora_flags(args),
            optimizer=choice("--optimizer", args.optimizer, OPTIMIZERS),
            modes=modes,
            dtype=choice("--dtype", args.dtype, list(DTYPES)),
            search=not args.no_search,
            keep_traces=bool(args.plot or args.trace_dir),
            gpu=choice("--gpu", args.gpu.lower(), list(GPUS)),
            cluster=cluster,
            workers=None if args.jobs is None else positive_int("--jobs", args.jobs),
            cache=not args.no_cache,
            **memory_of(args, cluster),
        )
    result.host_memory_source = HOST_FROM_FLAG if args.host_memory is not None else HOST_FROM_THIS_MACHINE
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
        if args.host_memory is None:  # stdout stays JSON (host_memory_source says it); the warning goes to stderr
            for line in this_machine_warning(result.host_memory):
                print(f"hf-memo estimate: warning: {line}", file=sys.stderr)
    else:
        print(result.table())
        if args.trace_dir:
            print(f"\nTraces: {', '.join(str(Path(args.trace_dir) / f'{m}.jsonl') for m in result.traces)}")
        if args.plot:
            print(f"Timeline plot: {args.plot}")
    return 0
