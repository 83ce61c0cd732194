"""Per-rank memory of Llama-3-8B at 128K tokens under DeepSpeed ZeRO-3: hf_memo (memo executor) vs HF checkpointing.

On paper: every number is arithmetic over the model's shapes (bf16 weights and activations, fp32 Adam state),
written out below so each can be checked. 8 ranks share ZeRO-3; two layouts of a 131072-token sequence:

* ``sp=8``: hf_memo's Ulysses splits each sequence over the 8 ranks (ALST's layout), 16384 tokens per rank;
* ``sp=1``: data parallelism only, every rank trains its own 131072-token sequence.

Parameter memory per rank: the ZeRO-3 partitions (weights, gradients, optimizer state, all / 8) plus the largest
set of weights gathered at once. DeepSpeed gathers per submodule for the unpatched model (the largest inside a
layer is one MLP projection) with its prefetch bucket on top; hf_memo gathers a whole decoder layer once per
pass (tests/test_parallel_zero3.py counts it) and the LM head with the final norm for the loss. Activation
memory per rank: what the step keeps for backward and the largest transient of backward (one recomputed layer
for checkpointing, one chunk for hf_memo), plus the loss: transformers' loss builds the full logits (bf16, then
an fp32 copy and the fp32 log-softmax cross-entropy saves), hf_memo's mini-sequence loss one chunk of them.

    python benchmarks/zero3_memory.py      # writes benchmarks/results/<date>-cpu/zero3_memory.{json,md}
"""

from __future__ import annotations

import argparse
import json
import math

from common import add_out_option, results_folder

GiB = 2**30
BF16, FP32 = 2, 4
RANKS = 8
SEQ = 131072
PREFETCH_ELEMENTS = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size
LLAMA3_8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256)


def parameter_counts(m: dict) -> dict[str, int]:
    """Parameters of one decoder layer, its largest submodule, the embeddings, the LM head (untied), the model."""
    h, i, d = m["hidden"], m["intermediate"], m["head_dim"]
    attention = h * m["heads"] * d * 2 + h * m["kv_heads"] * d * 2  # q, o; k, v
    layer = attention + 3 * h * i + 2 * h  # + gate, up, down, 2 norms
    embeddings = head = m["vocab"] * h
    return {
        "layer": layer,
        "largest_submodule": h * i,
        "lm_head": head,
        "model": m["layers"] * layer + embeddings + head + h,
    }


def saved_per_token(m: dict) -> dict[str, int]:
    """Bytes per token of one decoder layer: what checkpointing's recomputation saves (the layer's full autograd
    set: norm inputs and outputs, q/k/v after RoPE, attention output and log-sum-exp, gate, up, SiLU, product),
    its input alone, and what the memo executor keeps of every layer (input + attention output)."""
    h, i, q, kv = m["hidden"], m["intermediate"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"]
    full = (2 * h + q + 2 * kv + q + 2 * h + 4 * i) * BF16 + m["heads"] * FP32
    return {"recomputed_layer": full, "layer_input": h * BF16, "memo_kept": (h + q) * BF16}


def per_rank(m: dict, sp: int) -> dict[str, dict[str, float]]:
    """GiB per rank for both contenders at ``SEQ`` tokens split over ``sp`` ranks."""
    tokens = SEQ // sp
    counts, per_token = parameter_counts(m), saved_per_token(m)
    partitions = counts["model"] * (BF16 + BF16 + 3 * FP32) / RANKS  # weights, grads, fp32 master + Adam m, v
    logits = tokens * m["vocab"] * (BF16 + FP32 + FP32)  # bf16 logits, fp32 upcast, fp32 log-softmax saved
    mlp_chunks = math.ceil(m["intermediate"] / m["hidden"])  # hf_memo's "auto" rule: chunk intermediate ~ H wide
    head_chunks = math.ceil(m["vocab"] / m["hidden"])
    head_gather = (counts["lm_head"] + m["hidden"]) * BF16
    checkpointing = {
        "parameter_partitions": partitions,
        "gathered_weights_in_a_layer": (counts["largest_submodule"] + PREFETCH_ELEMENTS) * BF16,
        "gathered_weights_peak": (counts["lm_head"] + PREFETCH_ELEMENTS) * BF16,
        "activations_kept_device": m["layers"] * tokens * per_token["layer_input"],
        "activations_kept_host": 0,
        "backward_transient": tokens * per_token["recomputed_layer"],
        "loss_transient": logits,
    }
    memo = {
        "parameter_partitions": partitions,
        "gathered_weights_in_a_layer": counts["layer"] * BF16,
        "gathered_weights_peak": max(counts["layer"] * BF16, head_gather),
        # offload_fraction=1: every layer's input and attention output on the host; two rounding buffers of one
        # layer's kept tensors on the device (the one being filled/drained and the next prefetched).
        "activations_kept_device": 2 * tokens * per_token["memo_kept"],
        "activations_kept_host": m["layers"] * tokens * per_token["memo_kept"],
        "backward_transient": tokens // mlp_chunks * per_token["recomputed_layer"],
        "loss_transient": logits / head_chunks,
    }
    return {
        name: {**{k: v / GiB for k, v in parts.items()}, "device_total": _device_total(parts) / GiB}
        for name, parts in (("zero3+hf_checkpointing", checkpointing), ("zero3+hf_memo", memo))
    }


def _device_total(parts: dict[str, float]) -> float:
    """Partitions + gathered weights + kept activations + the larger of the two transients (they never overlap)."""
    kept = parts["parameter_partitions"] + parts["gathered_weights_peak"] + parts["activations_kept_device"]
    return kept + max(parts["backward_transient"], parts["loss_transient"])


def _markdown(results: dict) -> str:
    lines = [
        f"# Llama-3-8B, {SEQ} tokens, DeepSpeed ZeRO-3 over {RANKS} ranks: GiB per rank (on paper)",
        "",
        "Formulas and assumptions: `benchmarks/zero3_memory.py`. hf_memo: recompute='memo', offload_fraction=1, "
        "auto mini-sequence chunks; checkpointing: transformers' non-reentrant gradient checkpointing of every layer "
        "and its full-logits loss.",
    ]
    for layout, contenders in results.items():
        names = list(contenders)
        lines += ["", f"## {layout}", "", "| GiB per rank | " + " | ".join(names) + " |"]
        lines.append("|---|" + "---:|" * len(names))
        for key in contenders[names[0]]:
            lines.append(f"| {key} | " + " | ".join(f"{contenders[n][key]:.2f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_option(parser)
    args = parser.parse_args()
    date, folder = results_folder(args.out)
    results = {f"sp={sp} ({SEQ // sp} tokens per rank)": per_rank(LLAMA3_8B, sp) for sp in (8, 1)}
    counts = parameter_counts(LLAMA3_8B)
    payload = {"date": date, "model": LLAMA3_8B, "ranks": RANKS, "seq_len": SEQ, "parameters": counts, **results}
    (folder / "zero3_memory.json").write_text(json.dumps(payload, indent=2))
    (folder / "zero3_memory.md").write_text(_markdown(results))
    print(_markdown(results))


if __name__ == "__main__":
    main()
