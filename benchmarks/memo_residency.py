"""Where activations live between forward and backward: HF gradient checkpointing vs the memo executor.

Fake-tensor allocation traces of one training step (no GPU needed), Llama-3-8B shapes (32 layers,
bf16, batch 1). For each mode, at the moment backward starts:

* device-resident activations: tensors made in forward and still alive on the device, i.e. what the
  step keeps for backward (hf_memo's own rounding/prefetch buffers are workspace, reported apart);
* host-resident activations: what the memo executor offloaded;
* and, for the whole step, the peak device bytes beyond parameters and gradients.

    python benchmarks/memo_residency.py               # S = 65536, writes benchmarks/results/<date>-cpu/
    python benchmarks/memo_residency.py --tiny --out /tmp/x
"""

from __future__ import annotations

import argparse
import json

import torch

import hf_memo
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.footprint import with_layers
from hf_memo.profiler.shapes import builtin_config
from hf_memo.profiler.step import trace_training_step
from hf_memo.profiler.trace import AllocationTrace

from common import add_out_option, results_folder

KiB = 1024
MODES = {
    "hf+checkpointing": None,
    "memo alpha=0": 0.0,
    "memo alpha=0.5": 0.5,
}


def _configure(model: torch.nn.Module, alpha: float | None) -> None:
    if alpha is None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf_memo.apply(model, recompute="memo", offload_fraction=alpha, host_memory_limit=2**50)


def residency(trace: AllocationTrace) -> dict[str, int]:
    """Bytes alive when backward starts: device activations, hf_memo's device workspace, host activations."""
    end = trace.meta["stage_starts"]["backward"]
    alive = {}
    for event in trace.events[:end]:
        if event.op == "malloc":
            alive[event.tensor_id] = event
        else:
            alive.pop(event.tensor_id, None)
    result = {"device_activations": 0, "device_workspace": 0, "host_activations": 0}
    for event in alive.values():
        if event.category not in ("activation", "temporary"):
            continue
        if event.location == "host":
            result["host_activations"] += event.size
        elif event.name is not None:
            result["device_workspace"] += event.size
        elif event.category == "activation":
            result["device_activations"] += event.size
    return result


def profile(config, alpha: float | None, seq_len: int) -> dict:
    model, session = fake_causal_lm(config, torch.bfloat16)
    with session:
        _configure(model, alpha)
        trace = trace_training_step(model, 1, seq_len, optimizer="none")
    top = peak(trace, "device")
    beyond_state = top.total - top.by_category["parameter"] - top.by_category["gradient"] - top.by_category["buffer"]
    return {
        **residency(trace),
        "peak_device_beyond_state": beyond_state,
        "peak_phase": top.phase,
        "peak_host": peak(trace, "host").total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small shapes for a smoke run")
    add_out_option(parser)
    args = parser.parse_args()
    date, out = results_folder(args.out)
    config = builtin_config("llama-3-8b")
    seq_len = 65536
    if args.tiny:
        config = with_layers(config, 6)
        config.hidden_size, config.intermediate_size, config.vocab_size = 256, 512, 1000
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 64
        seq_len = 2048
    layers = config.num_hidden_layers
    results = {
        "date": date,
        "shape": f"Llama-3-8B{' (tiny)' if args.tiny else ''}, {layers} layers, bf16, batch 1",
        "seq_len": seq_len,
        "modes": {},
    }
    for name, alpha in MODES.items():
        results["modes"][name] = profile(config, alpha, seq_len)
        print(f"{name}: profiled", flush=True)
    gc_device = results["modes"]["hf+checkpointing"]["device_activations"]
    for record in results["modes"].values():
        record["device_ratio_to_hf_checkpointing"] = record["device_activations"] / gc_device
    lines = [
        f"{results['shape']}, S = {seq_len:,}; bytes per token when backward starts, and the step's peak",
        "",
        "| mode | device-resident activations | hf_memo device workspace | host-resident activations "
        "| vs HF checkpointing (device) | peak device beyond parameters and gradients |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results["modes"].items():
        per_token = {k: r[k] / seq_len / KiB for k in ("device_activations", "device_workspace", "host_activations")}
        lines.append(
            f"| {name} | {per_token['device_activations']:.1f} KiB | {per_token['device_workspace']:.1f} KiB | "
            f"{per_token['host_activations']:.1f} KiB | 1/{1 / r['device_ratio_to_hf_checkpointing']:.1f} | "
            f"{r['peak_device_beyond_state'] / 2**30:.2f} GiB ({r['peak_phase']}) |"
        )
    table = "\n".join(lines)
    (out / "memo_residency.json").write_text(json.dumps(results, indent=2))
    (out / "memo_residency.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
