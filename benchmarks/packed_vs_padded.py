"""Packed vs padded batches: peak memory, CPU step time and attention work of the same samples, per recompute mode.

The same samples of mixed lengths (32K tokens in all) are trained on as one padding-free packed row
(``position_ids`` restarting, hf_memo attending per sample) and as a batch padded to the longest
sample (``attention_mask``). Peak memory is profiled under ``FakeTensorMode`` with PyTorch's
``MemTracker`` for Llama-3-8B layer shapes (bf16, 4 layers); a fake profile has no token values, so it
measures the shapes, ``(1, S)`` against ``(samples, longest)`` (the attention pattern does not change
the memory of flash attention; the ``S x S`` mask unpatched transformers builds for a packed row is
reported beside). CPU step time is that of real fp32 steps on a small Llama. Attention work counts
the (query, key) pairs each layout computes.

    python benchmarks/packed_vs_padded.py                    # full run, writes benchmarks/results/<date>-cpu/
    python benchmarks/packed_vs_padded.py --tiny --out /tmp/x   # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_memo
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.footprint import with_layers
from hf_memo.profiler.memtracker import training_step_peak
from hf_memo.profiler.shapes import builtin_config
from hf_memo.runtime.batch_layout import BatchLayout

from common import add_out_option, results_folder, tiny_llama

GiB = 2**30
MODES = {
    "transformers (unpatched)": None,
    "none": {"recompute": "none"},
    "full": {"recompute": "full"},
    "selective": {"recompute": "selective"},
    # the host limit of an 8B-model machine, not this one's RAM: the peaks then show the executor, not a fallback
    "memo alpha=0.5": {"recompute": "memo", "offload_fraction": 0.5, "host_memory_limit": 2**40},
}
CHOICES = (256, 512, 1024, 2048, 4096, 8192)


def sample_lengths(total: int, longest: int, seed: int = 0) -> list[int]:
    """Mixed sample lengths (powers of two up to ``longest``, one of them ``longest``) summing to ``total``."""
    rng = random.Random(seed)
    lengths = [longest]
    while sum(lengths) < total:
        lengths.append(rng.choice([c for c in CHOICES if c <= longest]))
    lengths[-1] -= sum(lengths) - total
    return lengths


def attention_pairs(lengths: list[int]) -> dict:
    """(query, key) pairs: per sample (varlen), one causal row over all (no boundaries), padded rows."""
    total, longest = sum(lengths), max(lengths)
    packed = BatchLayout(total, (tuple(_spans(lengths)),))
    return {
        "per_sample": packed.attended_pairs(1),
        "whole_row_causal": total * (total + 1) // 2,
        "padded_rows": len(lengths) * longest * (longest + 1) // 2,
    }


def _spans(lengths: list[int]) -> list[tuple[int, int]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(start, start + n) for start, n in zip(starts, lengths)]


def fake_peak(config: LlamaConfig, mode: dict | None, batch: int, seq_len: int) -> int:
    """Peak bytes of one step on ``(batch, seq_len)`` tokens (``mode`` ``None``: the unpatched model)."""
    model, session = fake_causal_lm(config, torch.bfloat16)
    with session:
        if mode is not None:
            hf_memo.apply(model, **mode)
        return training_step_peak(model, batch, seq_len).total


def packed_batch(lengths: list[int], vocab: int) -> dict:
    ids = torch.randint(3, vocab, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "labels": ids.masked_fill(positions == 0, -100), "position_ids": positions}


def padded_batch(lengths: list[int], vocab: int) -> dict:
    longest = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), longest))
    mask = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def step_seconds(config: LlamaConfig, mode: dict | None, batch: dict) -> float:
    """Seconds of one fp32 training step (``mode`` ``None``: the unpatched model, without a cache so that it
    keeps packed samples apart, through its ``S x S`` mask)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    if mode is not None:
        hf_memo.apply(model, **mode)
    start = time.perf_counter()
    model(**batch, use_cache=False).loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    add_out_option(parser)
    args = parser.parse_args()
    date, out = results_folder(args.out)
    total, longest = (2048, 512) if args.tiny else (32768, 8192)
    lengths = sample_lengths(total, longest)
    torch.set_num_threads(1)
    fake_config = with_layers(builtin_config("llama-3-8b"), 4)
    small = tiny_llama(2)
    results = {"date": date, "machine": platform.processor() or platform.machine(), "lengths": lengths}
    results["attention_pairs"] = pairs = attention_pairs(lengths)
    results["modes"] = {}
    for name, mode in MODES.items():
        row = {
            "packed_peak_gib": fake_peak(fake_config, mode, 1, total) / GiB,
            "padded_peak_gib": fake_peak(fake_config, mode, len(lengths), longest) / GiB,
            "packed_step_s": step_seconds(small, mode, packed_batch(lengths, small.vocab_size)),
            "padded_step_s": step_seconds(small, mode, padded_batch(lengths, small.vocab_size)),
        }
        results["modes"][name] = row
        print(name, row, flush=True)
    (out / "packed_vs_padded.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"Packed vs padded: {len(lengths)} samples, {total:,} tokens, longest {longest:,} "
        f"({date}, {results['machine']})",
        "",
        "| mode | peak packed (GiB) | peak padded (GiB) | CPU step packed (s) | CPU step padded (s) |",
        "|---|---|---|---|---|",
    ]
    for name, row in results["modes"].items():
        lines.append(
            f"| {name} | {row['packed_peak_gib']:.2f} | {row['padded_peak_gib']:.2f} | "
            f"{row['packed_step_s']:.2f} | {row['padded_step_s']:.2f} |"
        )
    mask_gib = total * total / GiB
    lines += [
        "",
        f"Fake peaks measure the shapes only: for the packed row, unpatched transformers also builds an S x S "
        f"boolean mask ({mask_gib:.2f} GiB at S = {total:,}), which hf_memo does not.",
        "",
        f"Attention (query, key) pairs: per sample {pairs['per_sample']:,}; one causal row without boundaries "
        f"{pairs['whole_row_causal']:,} ({pairs['whole_row_causal'] / pairs['per_sample']:.1f}x); padded rows "
        f"{pairs['padded_rows']:,} ({pairs['padded_rows'] / pairs['per_sample']:.1f}x).",
    ]
    (out / "packed_vs_padded.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
