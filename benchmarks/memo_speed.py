"""CPU step time of the memo executor beside Hugging Face gradient checkpointing, measured in one run.

Real float32 training steps (forward + backward, no optimizer) of a small randomly initialised Llama
(hidden 256, 8 query heads, 2 KV heads, intermediate 768, 2 layers, vocab 4096: about six seconds a
step at S = 8192 on two cores, more when other work shares them), batch 1, at each sequence length.
The contenders, each a fresh model built from the same seed:

* ``hf-checkpointing``: ``gradient_checkpointing_enable`` (non-reentrant);
* ``memo X+attn``: ``hf_memo.apply(recompute="memo", offload_fraction=0.0)``, every layer keeping its
  input and attention output on the host (attention never recomputed);
* ``memo X only``: the same, every layer keeping its input only (attention recomputed in backward);
* ``memo alpha 0.5``: ``offload_fraction=0.5``, every layer ``X+attn`` on the host, alpha 0.5.

Per length, each contender runs one warm-up step, then one step under a dispatch mode that counts the
aten attention kernels it issues (forward pass and backward pass apart; also the executor's own
``MemoRuntime.attention_calls``), then ``--repeats`` timed steps, interleaved round-robin across the
contenders so that machine noise hits all alike. Reported: the median step seconds, tokens per second,
the ratio of each to ``hf-checkpointing`` in the same run, attention kernel calls per layer, and each
contender's loss against ``hf-checkpointing``'s (same weights, same batch: a sanity check).

    python benchmarks/memo_speed.py                      # S = 2048, 4096, 8192; benchmarks/results/<date>-cpu/
    python benchmarks/memo_speed.py --seq-lens 1024 2048 --repeats 5
    python benchmarks/memo_speed.py --tiny --out /tmp/x  # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

import hf_memo
from hf_memo.patches.apply import memo_runtime
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy

from common import add_out_option, results_folder, tiny_llama

REFERENCE = "hf-checkpointing"
HOST_LIMIT = 2**40  # no host limit: every contender runs the policy it names
ATTENTION_OPS = ("scaled_dot_product", "_flash_attention", "_efficient_attention")
CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
)


def hf_checkpointing(model: nn.Module) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def memo(keep_attention: bool, alpha: float) -> Callable[[nn.Module], None]:
    """Configure the memo executor to run every layer ``keep_attention`` / host / ``alpha``."""

    def configure(model: nn.Module) -> None:
        hf_memo.apply(model, recompute="memo", offload_fraction=alpha, host_memory_limit=HOST_LIMIT)
        layers = model.config.num_hidden_layers
        layer = LayerPolicy(keep_attention=keep_attention, on_host=True, alpha=alpha)
        memo_runtime(model).assume_policy(MemoryPolicy((layer,) * layers))

    return configure


CONTENDERS: dict[str, Callable[[nn.Module], None]] = {
    REFERENCE: hf_checkpointing,
    "memo X+attn": memo(True, 0.0),
    "memo X only": memo(False, 0.0),
    "memo alpha 0.5": memo(True, 0.5),
}


def benchmark_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=4096,
        num_hidden_layers=2,
        max_position_embeddings=1 << 16,
    )


def describe(config: LlamaConfig, tiny: bool) -> str:
    return (
        f"{'tiny ' if tiny else ''}Llama (hidden {config.hidden_size}, {config.num_attention_heads} heads, "
        f"{config.num_key_value_heads} KV heads, intermediate {config.intermediate_size}, "
        f"{config.num_hidden_layers} layers, vocab {config.vocab_size}), float32, batch 1"
    )


class AttentionKernels(TorchDispatchMode):
    """Counts the aten attention kernels issued while active, by op name and by ``phase`` (set by the caller)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.counts: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]  # the op, without its overload
        if any(key in name for key in ATTENTION_OPS):
            self.counts[self.phase, name] += 1
        return func(*args, **(kwargs or {}))


def build(config: LlamaConfig, configure: Callable[[nn.Module], None], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().train()
    configure(model)
    return model


def step(model: nn.Module, ids: torch.Tensor) -> tuple[float, float, float]:
    """One training step on ``ids``: (forward seconds, backward seconds, loss)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    middle = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    return middle - start, end - middle, loss.item()


def counted_step(model: nn.Module, ids: torch.Tensor) -> dict:
    """One untimed step under :class:`AttentionKernels`: attention kernels per layer by phase, the executor's
    attention calls, and the loss."""
    runtime = memo_runtime(model)
    calls_before = runtime.attention_calls if runtime is not None else 0
    model.zero_grad(set_to_none=True)
    with AttentionKernels() as kernels:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        kernels.phase = "backward"
        loss.backward()
    layers = model.config.num_hidden_layers
    per_layer = {"forward": {}, "backward": {}}
    for (phase, name), count in sorted(kernels.counts.items()):
        per_layer[phase][name] = count / layers
    return {
        "kernels_per_layer": per_layer,
        "forward_per_layer": sum(per_layer["forward"].values()),
        "backward_per_layer": sum(per_layer["backward"].values()),
        # kernels of a forward op run during the backward pass: attention recomputed
        "recomputed_per_layer": sum(n for name, n in per_layer["backward"].items() if not name.endswith("_backward")),
        "memo_attention_calls": None if runtime is None else runtime.attention_calls - calls_before,
        "memo_policy": None if runtime is None or runtime.plan is None else runtime.plan.summary(),
        "loss": loss.item(),
    }


def measure_length(config: LlamaConfig, seq_len: int, repeats: int, seed: int) -> dict:
    """Every contender at ``seq_len``: warm-up, counted step, then ``repeats`` timed rounds over all of them."""
    ids = torch.randint(3, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seed + 1))
    models = {name: build(config, configure, seed) for name, configure in CONTENDERS.items()}
    rows: dict[str, dict] = {}
    for name, model in models.items():
        step(model, ids)
        rows[name] = {**counted_step(model, ids), "forward_s": [], "backward_s": [], "step_s": [], "losses": []}
        print(
            f"S={seq_len} {name}: warmed up, {rows[name]['forward_per_layer']:g} / "
            f"{rows[name]['backward_per_layer']:g} attention kernels per layer",
            flush=True,
        )
    names = list(models)
    for round_ in range(repeats):
        # round-robin, starting one contender later each round: no contender always runs first or last
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            gc.collect()
            forward, backward, loss = step(models[name], ids)
            row = rows[name]
            row["forward_s"].append(forward)
            row["backward_s"].append(backward)
            row["step_s"].append(forward + backward)
            row["losses"].append(loss)
        print(f"S={seq_len}: round {round_ + 1}/{repeats} done", flush=True)
    reference = rows[REFERENCE]
    for row in rows.values():
        row["median_s"] = statistics.median(row["step_s"])
        row["fastest_s"] = min(row["step_s"])  # the least disturbed step, beside the median on a shared machine
        row["median_forward_s"] = statistics.median(row["forward_s"])
        row["median_backward_s"] = statistics.median(row["backward_s"])
        row["tokens_per_s"] = seq_len / row["median_s"]
    for row in rows.values():
        row["ratio_to_hf_checkpointing"] = row["median_s"] / reference["median_s"]
        losses = [row["loss"], *row["losses"]]
        references = [reference["loss"], *reference["losses"]]
        row["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(losses, references))
    del models
    gc.collect()
    return rows


def table(results: dict) -> str:
    lines = [
        f"{results['shape']}; forward + backward, no optimizer; median of {results['repeats']} interleaved steps "
        f"({results['date']}, {results['machine']}, torch {results['torch']}, {results['threads']} threads)",
        "",
        "| length | contender | median s | fastest s | tokens/s | vs HF checkpointing "
        "| attention kernels per layer fwd / bwd (recomputed) | memo attention calls per step | max abs loss diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seq_len, rows in results["lengths"].items():
        for name, r in rows.items():
            calls = "" if r["memo_attention_calls"] is None else str(r["memo_attention_calls"])
            lines.append(
                f"| {int(seq_len):,} | {name} | {r['median_s']:.3f} | {r['fastest_s']:.3f} | "
                f"{r['tokens_per_s']:,.0f} | "
                f"{r['ratio_to_hf_checkpointing']:.2f}x | {r['forward_per_layer']:g} / {r['backward_per_layer']:g} "
                f"({r['recomputed_per_layer']:g}) | {calls} | {r['max_abs_loss_diff']:.1e} |"
            )
    lines += [
        "",
        "tokens/s and vs HF checkpointing: of the median step; the ratio is over hf-checkpointing's median in the "
        "same run (below 1: faster). Fastest: the quickest of the timed steps (the least disturbed by other work). "
        "Attention kernels: aten attention ops issued in the forward pass / the backward pass, per layer "
        "(in brackets, forward kernels of the backward pass: attention recomputed). Loss diff: against "
        "hf-checkpointing's loss, same weights and batch (float32).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--seq-lens", type=int, nargs="+", default=None, help="sequence lengths (default 2048 4096 8192)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per contender and length (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own; 1 with --tiny)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model and lengths: a seconds-long smoke run")
    add_out_option(parser)
    args = parser.parse_args()
    date, out = results_folder(args.out)
    if args.tiny:
        config, seq_lens, repeats = tiny_llama(2), args.seq_lens or [128, 256], args.repeats or 2
    else:
        config, seq_lens, repeats = benchmark_config(), args.seq_lens or [2048, 4096, 8192], args.repeats or 3
    if repeats < 1 or any(n < 1 for n in seq_lens) or (args.threads is not None and args.threads < 1):
        parser.error("--repeats, --seq-lens and --threads must be >= 1")
    threads = args.threads or (1 if args.tiny else None)
    if threads is not None:
        torch.set_num_threads(threads)  # --tiny: on a busy machine no thread waits on another process's core
    results = {
        "date": date,
        "shape": describe(config, args.tiny),
        "config": {key: getattr(config, key) for key in CONFIG_FIELDS},
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_memo": hf_memo.__version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "seed": args.seed,
        "contenders": list(CONTENDERS),
        "lengths": {},
    }
    for seq_len in seq_lens:
        results["lengths"][str(seq_len)] = measure_length(config, seq_len, repeats, args.seed)
    text = table(results)
    (out / "memo_speed.json").write_text(json.dumps(results, indent=2))
    (out / "memo_speed.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
