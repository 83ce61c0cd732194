"""Sequence-parallel benchmark: per-GPU activation memory and per-layer all-to-all volume vs the SP degree.

One rank of each sequence-parallel degree (1, 2, 4, 8) is profiled under ``FakeTensorMode`` with
PyTorch's ``MemTracker`` (deterministic, no GPU): the real hf_memo code path runs, with a fake process
group of 8 ranks standing in for the others (its collectives move no data but have the real shapes),
so the rank holds ``S / sp`` tokens and its attention runs over the whole sequence for ``heads / sp``
heads, exactly as after the all-to-all. Every collective the step issues is recorded (shape, dtype,
forward or backward), and the all-to-all volume is checked against the closed form
``B * S/sp * head_dim * (2 * heads + 2 * sum_r kv_r) * bytes`` per layer and direction (``kv_r``: the KV heads rank
``r`` attends with, ``max(kv_heads, sp) / sp`` each where ``sp`` divides the heads).

    python benchmarks/sequence_parallel.py                        # Llama-3-8B layer shapes, about 1 minute
    python benchmarks/sequence_parallel.py --tiny --out /tmp/x   # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from tqdm.auto import tqdm
from transformers import LlamaConfig

import hf_memo
from hf_memo.parallel.heads import HeadSplit
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.footprint import with_layers
from hf_memo.profiler.memtracker import training_step_peak
from hf_memo.profiler.shapes import builtin_config

from common import add_out_option, results_folder, tiny_llama

GiB, MiB = 2**30, 2**20
WORLD = 8
DEGREES = (1, 2, 4, 8)
MODES = {"hf_memo": False, "hf_memo+checkpointing": True}  # mode -> HF gradient checkpointing


class CollectiveLog:
    """Records every all-to-all and all-reduce hf_memo issues, with the phase (forward/backward) it happens in."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_reduce")}

        def logged(name: str):
            def call(*args, **kwargs):
                tensor = args[1] if name == "all_to_all_single" else args[0]
                phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
                nbytes = tensor.numel() * tensor.element_size()
                self.records.append({"op": name, "phase": phase, "shape": list(tensor.shape), "bytes": nbytes})
                return originals[name](*args, **kwargs)

            return call

        for name in originals:
            setattr(dist, name, logged(name))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)

    def all_to_all(self, phase: str) -> list[dict]:
        return [r for r in self.records if r["op"] == "all_to_all_single" and r["phase"] == phase]


def expected_all_to_all_bytes(config: LlamaConfig, seq_len: int, sp: int, element_size: int) -> int:
    """All-to-all buffer bytes of one layer in one direction: q, k, v in and the output back (each KV head once for
    every rank that attends with it)."""
    head_dim = config.hidden_size // config.num_attention_heads
    kv = sum(map(len, HeadSplit(config.num_attention_heads, config.num_key_value_heads, sp).kvs))
    return seq_len // sp * head_dim * (2 * config.num_attention_heads + 2 * kv) * element_size


def profile(config: LlamaConfig, mode: str, sp: int, seq_len: int) -> dict:
    model, session = fake_causal_lm(config, torch.bfloat16)
    log = CollectiveLog()
    with session:
        if MODES[mode]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf_memo.apply(model, sequence_parallel_size=sp)
        with log.recording():
            peak = training_step_peak(model, 1, seq_len).to_dict()
    layers = config.num_hidden_layers
    result = {"peak": peak, "collectives": len(log.records)}
    for phase in ("forward", "backward"):
        exchanges = log.all_to_all(phase)
        buffer_bytes = sum(r["bytes"] for r in exchanges)
        result[f"all_to_all_{phase}"] = {
            "calls_per_layer": len(exchanges) / layers,
            "buffer_bytes_per_layer": buffer_bytes / layers,
            # the piece a rank keeps for itself never leaves it
            "sent_bytes_per_layer": buffer_bytes / layers * (sp - 1) / sp,
        }
    result["expected_buffer_bytes_per_layer"] = expected_all_to_all_bytes(config, seq_len, sp, 2) if sp > 1 else 0
    return result


def markdown(results: dict) -> str:
    seq_len = results["seq_len"]
    lines = [
        f"Per-GPU memory of one training step, {results['shape']}, S = {seq_len:,} tokens per sequence.",
        "",
        "| SP degree | mode | tokens per GPU | activations* (GiB) | x of SP=1 | ideal 1/SP "
        "| 1 GPU with S/SP tokens (GiB) | peak total (GiB) | all-to-all per layer, fwd / bwd (MiB sent per GPU) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        base = results["runs"][mode]["1"]["peak"]["activations"]
        for sp in DEGREES:
            run = results["runs"][mode][str(sp)]
            activations = run["peak"]["activations"]
            alone = results["one_gpu_same_tokens"][mode][str(sp)]["activations"]
            forward = run["all_to_all_forward"]["sent_bytes_per_layer"] / MiB
            backward = run["all_to_all_backward"]["sent_bytes_per_layer"] / MiB
            total = run["peak"]["total"]
            lines.append(
                f"| {sp} | {mode} | {seq_len // sp:,} | {activations / GiB:.2f} | {activations / base:.3f} | "
                f"{1 / sp:.3f} | {alone / GiB:.2f} | {total / GiB:.2f} | {forward:.0f} / {backward:.0f} |"
            )
    lines += [
        "",
        "*activations = peak total minus parameters and gradients (activations + temporaries at the peak). "
        "All-to-all: bytes each GPU sends per decoder layer (q, k, v in; attention output back; in backward the "
        "same for their gradients); with HF checkpointing the recomputed forward adds its exchanges to backward. "
        '"1 GPU with S/SP tokens": activations of a single-GPU step on a sequence of S/SP tokens, for comparison.',
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes for a smoke run")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 131072; tiny 4096)")
    add_out_option(parser)
    args = parser.parse_args()

    date, out = results_folder(args.out)
    layers = 2 if args.tiny else 4
    config = tiny_llama(layers, heads=8) if args.tiny else with_layers(builtin_config("llama-3-8b"), layers)
    seq_len = args.seq_len or (4096 if args.tiny else 131072)
    shape = ("tiny Llama" if args.tiny else "Llama-3-8B layer shapes") + f", {layers} layers, bf16, batch 1"
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    results: dict = {
        "date": date,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "shape": shape,
        "seq_len": seq_len,
        "world": WORLD,
        "runs": {mode: {} for mode in MODES},
        "one_gpu_same_tokens": {mode: {} for mode in MODES},
    }
    try:
        for mode, sp in tqdm([(m, s) for m in MODES for s in DEGREES], desc="profiling", unit="run"):
            results["runs"][mode][str(sp)] = profile(config, mode, sp, seq_len)
            alone = profile(config, mode, 1, seq_len // sp) if sp > 1 else results["runs"][mode]["1"]
            results["one_gpu_same_tokens"][mode][str(sp)] = alone["peak"]
    finally:
        dist.destroy_process_group()
    runs = results["runs"]
    results["activation_ratio_vs_sp1"] = {
        mode: {sp: runs[mode][sp]["peak"]["activations"] / runs[mode]["1"]["peak"]["activations"] for sp in runs[mode]}
        for mode in MODES
    }
    (out / "sequence_parallel.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (out / "sequence_parallel.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
