"""Memo's memory policy against mini-sequence + checkpointing: the longest sequence over a grid of GPU and host memory.

Llama-3-8B, bf16, batch 1, one GPU, the fast estimator (``hf_memo.estimate``: a closed form from a few fresh
fake-tensor profiles; no GPU needed). For every GPU memory x host memory x trainable cell: minseq's longest sequence
and memo's (the longest for which some memory policy fits device and host), what binds each, memo's policy there
and both step-time bounds (FLOPs at the H100's peak plus unhidden copies; a lower bound, not a measurement). Each
cell is one ``estimate`` call, as a user would ask it; each finished cell is written at once.

    python benchmarks/policy_grid.py                      # writes benchmarks/results/<date>-cpu/policy_grid.*
    python benchmarks/policy_grid.py --tiny --out /tmp/x  # seconds-long smoke run on a tiny Llama
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from hf_memo.estimator.cluster import DEVICE_RESERVE, HOST_RESERVE_NODE, HOST_RESERVE_PER_RANK, PINNABLE_FRACTION
from hf_memo.estimator.estimate import estimate
from hf_memo.profiler.shapes import builtin_config

from common import add_out_option, results_folder, tiny_llama

GiB = 2**30
GPU_GIB = (24, 48, 80, 139)
HOST_GIB = (32, 128, 1024)
TRAINABLE = ("lora", "full")


def markdown(results: dict) -> str:
    lines = [
        f"Longest sequence, {results['model']}, bf16, batch 1, one GPU: mini-sequence + HF checkpointing (minseq) vs "
        "the memo executor under its solved memory policy (memo), from the fast estimator. Step times are lower "
        f"bounds: FLOPs at the {results['gpu']} bf16 peak (989 TFLOP/s, assumed) plus host copies at 25 GB/s "
        f"(assumed) that compute cannot hide. {results['budgets']}",
        "",
        "| trainable | GPU | host | minseq longest (bound by) | memo longest (bound by) | memo/minseq | "
        "memo policy at its longest | step time bound minseq / memo at memo's longest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in results["cells"]:
        ratio = f"{cell['memo_longest'] / cell['minseq_longest']:.2f}" if cell["minseq_longest"] else "-"
        minseq_seconds = cell["minseq_step_seconds"]
        minseq_time = "does not fit" if minseq_seconds is None else f"{minseq_seconds:.1f} s"
        times = f"{minseq_time} / {cell['memo_step_seconds']:.1f} s" if cell["memo_step_seconds"] is not None else "-"
        lines.append(
            f"| {cell['trainable']} | {cell['gpu_gib']} GiB | {cell['host_gib']} GiB | "
            f"{cell['minseq_longest']:,} ({cell['minseq_binding']}) | "
            f"{cell['memo_longest']:,} ({cell['memo_binding']}) | {ratio} | {cell['memo_policy']} | {times} |"
        )
    lines += [
        "",
        f"{len(results['cells'])} of {results['cells_planned']} cells; wall time {results['seconds']:.0f} s "
        f"on {results['machine']} (CPU only, shared), {results['seconds'] / max(len(results['cells']), 1):.1f} s "
        "per cell (two estimate calls: the longest, then the step at it).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny Llama, for a smoke run")
    parser.add_argument("--trainable", choices=TRAINABLE, default=None, help="one setting only")
    add_out_option(parser)
    args = parser.parse_args()
    trainables = TRAINABLE if args.trainable is None else (args.trainable,)
    stem = "policy_grid" if args.trainable is None else f"policy_grid_{args.trainable}"
    date, out = results_folder(args.out)
    config = tiny_llama(6) if args.tiny else builtin_config("llama-3-8b")
    unit = 2**20 if args.tiny else GiB
    start_len = 1024 if args.tiny else 32768
    results = {
        "model": "tiny Llama (6 layers)" if args.tiny else "Llama-3-8B",
        "gpu": "H100 SXM",
        "budgets": "Budgets: the whole GPU and host."
        if args.tiny
        else "Budgets as the command line sets them: the GPU less a 3 GiB reserve, the host less 12 GiB, 75% of the "
        "rest pinnable.",
        "unit": unit,
        "cells_planned": len(GPU_GIB) * len(HOST_GIB) * len(trainables),
        "machine": platform.processor() or platform.machine(),
        "cells": [],
        "seconds": 0.0,
    }
    started = time.perf_counter()
    for trainable in trainables:
        for gpu_gib in GPU_GIB:
            for host_gib in HOST_GIB:
                cell_start = time.perf_counter()
                budget = {"gpu_memory": gpu_gib * unit, "host_memory": host_gib * unit, "trainable": trainable}
                if not args.tiny:  # the command line's defaults: what a user asking the same question gets
                    host_reserve = HOST_RESERVE_NODE + HOST_RESERVE_PER_RANK
                    pinned = int(PINNABLE_FRACTION * (host_gib * unit - host_reserve))
                    budget.update(reserve=DEVICE_RESERVE, host_reserve=host_reserve, pinned_memory=pinned)
                found = estimate(config, start_len, modes=["minseq", "memo"], progress=False, **budget).modes
                longest = found["memo"].longest_seq_len
                at = None  # nothing fits at all (e.g. full fine-tuning's states alone): no step
                if longest:
                    at = estimate(config, longest, modes=["minseq", "memo"], search=False, progress=False, **budget)
                results["cells"].append(
                    {
                        "trainable": trainable,
                        "gpu_gib": gpu_gib,
                        "host_gib": host_gib,
                        "minseq_longest": found["minseq"].longest_seq_len,
                        "minseq_binding": found["minseq"].binding,
                        "memo_longest": longest,
                        "memo_binding": found["memo"].binding,
                        "memo_policy": at.modes["memo"].policy if at else "-",
                        "memo_step_seconds": at.modes["memo"].step_seconds if at else None,
                        "memo_mfu_bound": at.modes["memo"].mfu if at else None,
                        "minseq_step_seconds": at.modes["minseq"].step_seconds if at else None,
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
