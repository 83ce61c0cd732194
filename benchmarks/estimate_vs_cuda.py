"""On a CUDA GPU: the fake-tensor estimate beside what the GPU really allocates, per mode.

Llama-3-8B layer shapes with 4 layers, bf16, batch 1, AdamW, S = 32768 (by default). For each mode
the same training step runs on the GPU (random weights) and on fake tensors; the script writes
``torch.cuda.max_memory_allocated`` beside the fake peak, the peak of the CUDA allocator's own
trace (``cuda_training_step_trace``), one layer's forward time and the pinned copy bandwidth.

    python benchmarks/estimate_vs_cuda.py            # writes benchmarks/results/<date>-cuda/
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from hf_memo.estimator.setups import MODES
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.footprint import StepProfiler, with_layers
from hf_memo.profiler.gpu import cuda_training_step_trace, offload_inputs
from hf_memo.profiler.shapes import builtin_config
from hf_memo.profiler.step import steady_optimizer, token_batch, training_step

from common import add_out_option, results_folder

GiB = 2**30


def cuda_peak(config, mode: str, seq_len: int) -> dict:
    """Peak bytes the GPU allocates in one step, and its allocator trace's peak (a second step)."""
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    MODES[mode].configure(model, None)
    optimizer = steady_optimizer(model, "adamw")
    ids = token_batch(model, 1, seq_len)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    training_step(model, ids, optimizer)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated()
    del ids, optimizer
    trace = cuda_training_step_trace(model, 1, seq_len)
    result = {"max_memory_allocated": allocated, "allocator_trace_peak": peak(trace).total}
    if mode == "hf":
        inputs = offload_inputs(model, seq_len)
        result["offload_inputs"] = inputs.__dict__
    del model
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=4)
    add_out_option(parser, "cuda")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("estimate_vs_cuda.py needs a CUDA GPU; the CPU estimate is benchmarks/estimate_table.py")
    _, out = results_folder(args.out, "cuda")
    config = with_layers(builtin_config("llama-3-8b"), args.layers)
    results = {"gpu": torch.cuda.get_device_name(), "seq_len": args.seq_len, "layers": args.layers, "modes": {}}
    for mode in ("hf", "hf-checkpointing", "full"):

        def prepare(model, session, mode=mode):
            MODES[mode].configure(model, None)
            return model

        fake = peak(StepProfiler(config, prepare).trace(args.seq_len)).total
        real = cuda_peak(config, mode, args.seq_len)
        real["fake_peak"] = fake
        real["fake_over_cuda"] = fake / real["max_memory_allocated"]
        results["modes"][mode] = real
        print(mode, {k: (v / GiB if isinstance(v, int) else v) for k, v in real.items()}, flush=True)
    (out / "estimate_vs_cuda.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
