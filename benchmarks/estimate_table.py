"""Estimator table: the longest sequence that fits an 80 GiB GPU, Llama-3-8B, plain HF vs HF checkpointing vs hf_memo.

AdamW full fine-tuning, bf16 weights and optimizer states, batch 1, 128 GiB host memory (memo's offload target;
stated rather than this machine's, so the table does not depend on where it runs), fake-tensor profiles (no GPU
needed), beside the Mini-Sequence Transformer paper's A100-80G measurements for the same setups.
The run also checks the layer extrapolation against a full 32-layer profile and draws the memory
timeline of one step per mode.

    python benchmarks/estimate_table.py                   # writes benchmarks/results/<date>-cpu/
    python benchmarks/estimate_table.py --tiny --out /tmp/x   # seconds-long smoke run on a tiny Llama
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import transformers

import hf_memo
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.plot import plot_timelines
from hf_memo.profiler.shapes import builtin_config

from common import add_out_option, results_folder, tiny_llama

GiB = 2**30
HOST_GIB = 128
MODES = ("hf", "hf-checkpointing", "full", "memo")
# Modes whose memory is their profile's (memo's is its solved policy's, built from profiles at depths 4 and 5).
PROFILED = MODES[:3]
# Mini-Sequence Transformer paper, Llama3-8B on one A100-80G, AdamW full fine-tuning, bf16.
MST_PAPER = {"hf": "5K", "hf-checkpointing": "14K", "full": "60K", "memo": "-"}
MST_LABELS = {
    "hf": "Llama 3 (no checkpointing)",
    "hf-checkpointing": "activation checkpointing",
    "full": "MsT",
    "memo": "not in the paper",
}


def markdown(results: dict) -> str:
    gpu, at = results["gpu_memory_gib"], results["table_seq_len"]
    lines = [
        f"Longest sequence that fits one {gpu:g} GiB GPU with {results['host_memory_gib']:g} GiB host memory: "
        f"{results['model']}, {results['setup']}.",
        "",
        f"| mode | longest S (ours, estimated) | MsT paper, A100-80G | peak at S = {at:,} (GiB) |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        row = results["modes"][mode]
        lines.append(
            f"| {mode} | {row['longest_seq_len']:,} | {row['mst_paper']} ({MST_LABELS[mode]}) | "
            f"{row['peak_gib_at_table_seq_len']:.2f} |"
        )
    lines += [""] + [f"Method ({mode}): {method}." for mode, method in results["method"].items()] + [""]
    check = results["extrapolation_check"]
    lines.append(f"Extrapolation vs a full {check['layers']}-layer profile at S = {check['seq_len']:,}:")
    lines.append("")
    lines.append("| mode | extrapolated (GiB) | full profile (GiB) | difference |")
    lines.append("|---|---|---|---|")
    for mode in PROFILED:
        row = check["modes"][mode]
        lines.append(
            f"| {mode} | {row['extrapolated'] / GiB:.3f} | {row['full'] / GiB:.3f} | {row['relative_difference']:.2e} |"
        )
    lines.append("")
    lines.append(f"Estimator wall time: {results['seconds']:.0f} s on {results['machine']} (CPU only).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny Llama, for a smoke run")
    add_out_option(parser)
    args = parser.parse_args()

    date, out = results_folder(args.out)
    config = tiny_llama(6) if args.tiny else builtin_config("llama-3-8b")
    name = "tiny Llama (6 layers)" if args.tiny else "Llama-3-8B"
    gpu_memory = 24 * 2**20 if args.tiny else 80 * GiB
    host_memory = 2 * GiB if args.tiny else HOST_GIB * GiB
    seq_len = 2048 if args.tiny else 16384

    start = time.perf_counter()
    result = hf_memo.estimate(
        config, seq_len, gpu_memory=gpu_memory, host_memory=host_memory, modes=MODES, keep_traces=True
    )
    seconds = time.perf_counter() - start
    method = {mode: result.modes[mode].footprint.method for mode in MODES}
    check = {"layers": result.layers, "seq_len": seq_len, "modes": {}}
    for mode in PROFILED:
        extrapolated, full = result.modes[mode].footprint.device.total, peak(result.traces[mode]).total
        check["modes"][mode] = {
            "extrapolated": extrapolated,
            "full": full,
            "relative_difference": abs(extrapolated - full) / full,
        }
    results = {
        "date": date,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": name,
        "setup": "AdamW (fused, bf16 states) full fine-tuning, bf16 weights, batch 1",
        "gpu_memory_gib": gpu_memory / GiB,
        "host_memory_gib": host_memory / GiB,
        "method": method,
        "seconds": seconds,
        "table_seq_len": seq_len,
        "modes": {
            mode: {
                "description": result.modes[mode].description,
                "longest_seq_len": result.modes[mode].longest_seq_len,
                "mst_paper": MST_PAPER[mode],
                "peak_gib_at_table_seq_len": result.modes[mode].footprint.device.total / GiB,
                "peak_at_table_seq_len": result.to_dict()["modes"][mode]["footprint"]["device"],
            }
            for mode in MODES
        },
        "extrapolation_check": check,
    }
    (out / "estimate_table.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (out / "estimate_table.md").write_text(table + "\n")
    title = f"{name}, bf16, batch 1 x {seq_len:,} tokens, AdamW: device memory over one training step"
    plot_timelines(result.traces, out / "estimate_timeline.png", title, gpu_memory)
    print(result.table())
    print()
    print(table)


if __name__ == "__main__":
    main()
