"""Memo's memory policy against mini-sequence + checkpointing: the longest sequence over a grid of GPU and host memory.

Llama-3-8B, bf16, batch 1, fake-tensor profiles (no GPU needed). For every GPU memory x host memory x
trainable cell: minseq's longest sequence (its profile) and memo's (the longest for which some memory
policy fits device and host), memo's policy there and both predicted step times on an H100. Profiles
at one length are shared by the cells of one trainable setting. Each finished cell is written at once.

    python benchmarks/policy_grid.py                      # writes benchmarks/results/<date>-cpu/policy_grid.*
    python benchmarks/policy_grid.py --tiny --out /tmp/x  # seconds-long smoke run on a tiny Llama
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from hf_memo.integrations.estimate import memo_mode_estimate, profiled_mode_estimate
from hf_memo.integrations.memo_estimate import DEFAULT_GPU, MemoModel, gpu_of
from hf_memo.integrations.setups import MODES, memo_with_offload, with_lora
from hf_memo.profiler.footprint import Footprint, StepProfiler
from hf_memo.profiler.shapes import builtin_config

from common import add_out_option, results_folder, tiny_llama

GiB = 2**30
GPU_GIB = (24, 48, 80, 139)
HOST_GIB = (32, 128, 1024)
TRAINABLE = ("lora", "full")


class CachedProfiler(StepProfiler):
    """A :class:`StepProfiler` whose footprints and traces are kept, so every cell reuses a length's profile."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._footprints: dict[int, Footprint] = {}
        self._traces: dict = {}

    def footprint(self, seq_len: int) -> Footprint:
        if seq_len not in self._footprints:
            self._footprints[seq_len] = super().footprint(seq_len)
        return self._footprints[seq_len]

    def trace(self, seq_len: int, layers: int | None = None):
        key = (seq_len, layers)
        if key not in self._traces:
            self._traces[key] = super().trace(seq_len, layers)
        return self._traces[key]


def profilers(config, trainable: str):
    def prepare_with(configure):
        def prepare(model, session):
            if trainable == "lora":
                model = with_lora(model, session)
            configure(model)
            return model

        return prepare

    minseq = CachedProfiler(config, prepare_with(lambda m: MODES["minseq"].configure(m, None)), torch.bfloat16)

    def memo_profiler(fraction: float) -> StepProfiler:
        return CachedProfiler(
            config,
            prepare_with(memo_with_offload(fraction)),
            torch.bfloat16,
            profile_layers=MODES["memo"].profile_layers,
        )

    return minseq, memo_profiler


def markdown(results: dict) -> str:
    lines = [
        f"Longest sequence, {results['model']}, bf16, batch 1: mini-sequence + HF checkpointing (minseq) vs the memo "
        f"executor under its solved memory policy (memo). Step times: FLOPs at the {results['gpu']} peak plus "
        "unhidden host copies (see the README's cost model).",
        "",
        "| trainable | GPU | host | minseq longest | memo longest | memo/minseq | memo policy at its longest | "
        "step time minseq / memo at memo's longest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in results["cells"]:
        ratio = f"{cell['memo_longest'] / cell['minseq_longest']:.2f}" if cell["minseq_longest"] else "-"
        times = (
            f"{cell['minseq_step_seconds']:.1f} s / {cell['memo_step_seconds']:.1f} s"
            if cell["memo_step_seconds"] is not None
            else "-"
        )
        lines.append(
            f"| {cell['trainable']} | {cell['gpu_gib']} GiB | {cell['host_gib']} GiB | {cell['minseq_longest']:,} | "
            f"{cell['memo_longest']:,} | {ratio} | {cell['memo_policy']} | {times} |"
        )
    lines += [
        "",
        f"{len(results['cells'])} of {results['cells_planned']} cells; wall time {results['seconds']:.0f} s "
        f"on {results['machine']} (CPU only).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny Llama, for a smoke run")
    parser.add_argument(
        "--trainable", choices=TRAINABLE, default=None, help="one setting only (writes policy_grid_<it>.*)"
    )
    add_out_option(parser)
    args = parser.parse_args()
    trainables = TRAINABLE if args.trainable is None else (args.trainable,)
    stem = "policy_grid" if args.trainable is None else f"policy_grid_{args.trainable}"
    date, out = results_folder(args.out)
    config = tiny_llama(6) if args.tiny else builtin_config("llama-3-8b")
    unit = 2**20 if args.tiny else GiB
    gpu = gpu_of(DEFAULT_GPU)
    start_len = 1024 if args.tiny else 32768
    cells_planned = len(GPU_GIB) * len(HOST_GIB) * len(trainables)
    results = {
        "model": "tiny Llama (6 layers)" if args.tiny else "Llama-3-8B",
        "gpu": gpu.name,
        "unit": unit,
        "cells_planned": cells_planned,
        "machine": f"{platform.machine()}, {platform.processor() or ''}",
        "cells": [],
        "seconds": 0.0,
    }
    started = time.perf_counter()
    for trainable in trainables:
        minseq, memo_profiler = profilers(config, trainable)
        memo = MemoModel(memo_profiler, 1, gpu, allow_x_only=True)
        for gpu_gib in GPU_GIB:
            for host_gib in HOST_GIB:
                cell_start = time.perf_counter()
                gpu_bytes, host_bytes = gpu_gib * unit, host_gib * unit
                base = profiled_mode_estimate("minseq", minseq, start_len, gpu_bytes, host_bytes, True, 1 << 24, gpu)
                longest = memo_mode_estimate(memo, start_len, gpu_bytes, host_bytes, True, 1 << 24).longest_seq_len
                at = minseq_at = None  # nothing fits at all (e.g. full fine-tuning's weights alone): no step
                if longest:
                    at = memo_mode_estimate(memo, longest, gpu_bytes, host_bytes, False, 1 << 24)
                    minseq_at = profiled_mode_estimate(
                        "minseq", minseq, longest, gpu_bytes, host_bytes, False, 1 << 24, gpu
                    )
                results["cells"].append(
                    {
                        "trainable": trainable,
                        "gpu_gib": gpu_gib,
                        "host_gib": host_gib,
                        "minseq_longest": base.longest_seq_len,
                        "memo_longest": longest,
                        "memo_policy": at.policy if at else "-",
                        "memo_step_seconds": at.step_seconds if at else None,
                        "memo_mfu": at.mfu if at else None,
                        "minseq_step_seconds": minseq_at.step_seconds if minseq_at else None,
                        "cell_seconds": time.perf_counter() - cell_start,
                    }
                )
                results["seconds"] = time.perf_counter() - started
                (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
                (out / f"{stem}.md").write_text(markdown(results) + "\n")
                print(results["cells"][-1], flush=True)
    print(markdown(results))


if __name__ == "__main__":
    main()
