"""Mini-sequence memory benchmark: peak memory of one training step, plain HF vs hf_memo, side by side.

Memory is profiled under ``FakeTensorMode`` with PyTorch's ``MemTracker`` (deterministic, no GPU
needed) for Llama-3-8B layer shapes; CPU wall time of real steps on a small Llama is measured in the
same run, interleaved, so the ratios are not skewed by machine noise.

    python benchmarks/minseq_memory.py                 # full run, writes benchmarks/results/<date>-cpu/
    python benchmarks/minseq_memory.py --tiny --out /tmp/x   # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

import hf_memo
from hf_memo.minseq.chunking import resolve_chunks
from hf_memo.minseq.lm_head import causal_lm_loss
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.footprint import with_layers
from hf_memo.profiler.memtracker import peak_of, training_step_peak
from hf_memo.profiler.shapes import builtin_config

from common import add_out_option, results_folder, tiny_llama

GiB = 2**30
MODES = ("hf", "hf+checkpointing", "hf_memo", "hf_memo+checkpointing")


def step_peak(config: LlamaConfig, mode: str, seq_len: int) -> dict:
    model, fake_mode = fake_causal_lm(config, torch.bfloat16)
    with fake_mode:
        if "checkpointing" in mode:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mode.startswith("hf_memo"):
            hf_memo.apply(model)
        return training_step_peak(model, 1, seq_len).to_dict()


class HeadAndLoss(torch.nn.Module):
    """The LM head + loss as one module, so MemTracker sees repeated head calls as nested, not as new steps."""

    def __init__(self, head: torch.nn.Linear, chunks: int | None) -> None:
        super().__init__()
        self.head, self.chunks = head, chunks

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.chunks is None:
            return ForCausalLMLoss(self.head(hidden), labels, self.head.out_features)
        return causal_lm_loss(hidden, self.head, [self.head.weight], labels, self.chunks)


def lm_head_peak(config: LlamaConfig, chunked: bool, seq_len: int) -> dict:
    """Peak of the LM head + loss alone (forward and backward), excluding its weight and input."""
    model, fake_mode = fake_causal_lm(config, torch.bfloat16)
    with fake_mode:
        hidden = torch.randn(1, seq_len, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, config.vocab_size, (1, seq_len))
        defaults = hf_memo.MemoConfig()
        chunks = resolve_chunks(
            "auto",
            seq_len,
            config.vocab_size,
            config.hidden_size,
            defaults.min_chunk_tokens,
            defaults.max_chunk_elements,
        )
        head_and_loss = HeadAndLoss(model.lm_head, chunks if chunked else None)
        peak = peak_of(lambda: head_and_loss(hidden, labels).backward(), head_and_loss, hidden).to_dict()
        peak["excluding_inputs"] = peak["total"] - peak["parameter"] - hidden.numel() * hidden.element_size()
        peak["chunks"] = chunks if chunked else 1
        return peak


def wall_times(seq_len: int, repeats: int, tiny: bool) -> dict:
    """CPU seconds of one real fp32 training step, HF and hf_memo interleaved; the ratio uses the fastest run."""
    config = LlamaConfig(
        hidden_size=64 if tiny else 256,
        intermediate_size=224 if tiny else 768,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2000 if tiny else 32000,
        num_hidden_layers=2 if tiny else 4,
        max_position_embeddings=1 << 16,
    )
    torch.manual_seed(0)
    models = {"hf": LlamaForCausalLM(config).train()}
    models["hf_memo"] = hf_memo.apply(LlamaForCausalLM(config).train())
    models["hf_memo"].load_state_dict(models["hf"].state_dict())
    ids = torch.randint(0, config.vocab_size, (1, seq_len))
    times = {name: [] for name in models}
    for i in range(repeats + 1):
        order = list(models.items()) if i % 2 else list(models.items())[::-1]  # no first-runner bias
        for name, model in order:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            if i > 0:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    fastest = {name: min(t) for name, t in times.items()}
    return {
        "seconds_min": fastest,
        "seconds_median": {name: statistics.median(t) for name, t in times.items()},
        "repeats": repeats,
        "ratio_hf_memo_over_hf": fastest["hf_memo"] / fastest["hf"],
        "config": {
            "hidden": config.hidden_size,
            "intermediate": config.intermediate_size,
            "vocab": config.vocab_size,
            "layers": config.num_hidden_layers,
            "dtype": "float32",
        },
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq_lens = sorted(results["step_peak"], key=int)
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(6 * len(seq_lens), 4.5), squeeze=False)
    parts = [
        ("parameter", "parameters"),
        ("gradient", "gradients"),
        ("activation", "activations"),
        ("temporary", "temporaries"),
    ]
    for ax, seq_len in zip(axes[0], seq_lens):
        bottom = [0.0] * len(MODES)
        for key, label in parts:
            values = [results["step_peak"][seq_len][m][key] / GiB for m in MODES]
            ax.bar(MODES, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"one training step, S = {int(seq_len):,}")
        ax.set_ylabel("peak memory (GiB)")
        ax.tick_params(axis="x", rotation=20)
    axes[0][0].legend()
    fig.suptitle(results["shape"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(results: dict) -> str:
    lines = ["| S | mode | peak total (GiB) | activations* (GiB) | LM head + loss (GiB) |", "|---|---|---|---|---|"]
    for seq_len in sorted(results["step_peak"], key=int):
        head = results["lm_head_peak"][seq_len]
        for mode in MODES:
            peak = results["step_peak"][seq_len][mode]
            head_cell = head["hf_memo" if mode.startswith("hf_memo") else "hf"]["excluding_inputs"] / GiB
            total, activations = peak["total"] / GiB, peak["activations"] / GiB
            lines.append(f"| {int(seq_len):,} | {mode} | {total:.2f} | {activations:.2f} | {head_cell:.2f} |")
    lines.append("")
    lines.append("*activations = peak total minus parameters and gradients (activations + temporaries at the peak).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes for a smoke run")
    add_out_option(parser)
    args = parser.parse_args()

    date, out = results_folder(args.out)
    layers = 2 if args.tiny else 4
    config = tiny_llama(layers) if args.tiny else with_layers(builtin_config("llama-3-8b"), layers)
    seq_lens = (2048, 4096) if args.tiny else (16384, 65536)
    shape = ("tiny Llama" if args.tiny else "Llama-3-8B layer shapes") + f", {layers} layers, bf16, batch 1"
    results: dict = {
        "date": date,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "shape": shape,
        "step_peak": {},
        "lm_head_peak": {},
        "wall_time": {},
    }
    for seq_len in seq_lens:
        results["step_peak"][str(seq_len)] = {mode: step_peak(config, mode, seq_len) for mode in MODES}
        results["lm_head_peak"][str(seq_len)] = {
            "hf": lm_head_peak(config, False, seq_len),
            "hf_memo": lm_head_peak(config, True, seq_len),
        }
        print(f"S={seq_len}: profiled", flush=True)
    longest = str(seq_lens[-1])
    step, head = results["step_peak"][longest], results["lm_head_peak"][longest]
    results["ratios_at_longest"] = {
        "seq_len": int(longest),
        "lm_head_loss_hf_over_hf_memo": head["hf"]["excluding_inputs"] / head["hf_memo"]["excluding_inputs"],
        "activations_hf_checkpointing_over_hf_memo_checkpointing": step["hf+checkpointing"]["activations"]
        / step["hf_memo+checkpointing"]["activations"],
    }
    for seq_len in (256, 1024) if args.tiny else (512, 8192):
        repeats = 2 if args.tiny else (15 if seq_len <= 1024 else 5)
        results["wall_time"][str(seq_len)] = wall_times(seq_len, repeats=repeats, tiny=args.tiny)
        print(f"S={seq_len}: timed", flush=True)
    (out / "minseq_memory.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "minseq_memory.png")
    table = markdown(results)
    (out / "minseq_memory.md").write_text(table + "\n")
    print(table)
    print(
        json.dumps(
            {
                "ratios_at_longest": results["ratios_at_longest"],
                "wall_time_ratio": {s: r["ratio_hf_memo_over_hf"] for s, r in results["wall_time"].items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
