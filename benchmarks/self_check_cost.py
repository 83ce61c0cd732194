"""What hf_memo's self-check costs at the first training step of a Llama-3-8B-shaped model, measured on the CPU.

A Llama-3-8B-shaped model (hidden 4096, 14336 MLP, 32 query and 8 key/value heads, 128256 tokens of vocabulary) with
``--layers`` decoder layers, random weights in bf16, is patched with ``--recompute``; one training step of
``--tokens`` tokens runs with the self-check (the first step) and one without (a model patched with
``self_check=False``), side by side in one run. Reported: each step's seconds, the check's own seconds (its report),
and the bytes of what the check keeps between its two passes (layer outputs and gradients of the reference pass,
summed over the tensors it returns), with the gradient targets' bytes for comparison. The check's values cannot
exist under fake tensors (it compares numbers), so this runs real tensors.

    python benchmarks/self_check_cost.py --layers 2 --tokens 1024 \
        --out benchmarks/results/2026-11-28-cpu/self_check_cost.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

import hf_memo
from hf_memo.patches import self_check
from hf_memo.patches.patching import patch_state


def llama3_8b_shaped(layers: int) -> transformers.LlamaForCausalLM:
    """Llama-3-8B's shapes with ``layers`` decoder layers, random bf16 weights."""
    config = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()


def _step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = llama3_8b_shaped(args.layers)
    ids = torch.randint(3, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    kept: list[int] = []
    run = self_check._run

    def measured(*a: object) -> self_check._Run:
        result = run(*a)
        tensors = [*result.gradients.values(), *(t for pair in result.layers.values() for t in pair)]
        kept.append(sum(t.numel() * t.element_size() for t in tensors if t is not None))
        return result

    self_check._run = measured
    hf_memo.apply(model, recompute=args.recompute)
    checked = _step(model, ids)
    report = dict(patch_state(model).self_check.report)
    targets = self_check._targets(model, patch_state(model).structure, [0])
    hf_memo.revert(model)
    hf_memo.apply(model, recompute=args.recompute, self_check=False)
    plain = _step(model, ids)
    result = {
        "model": f"Llama-3-8B-shaped, {args.layers} layers, bf16, CPU",
        "tokens": args.tokens,
        "recompute": args.recompute,
        "first_step_with_check_s": checked,
        "step_without_check_s": plain,
        "check_s": report["seconds"],
        "check_share_of_first_step": report["seconds"] / checked,
        "bytes_kept_per_pass": kept,
        "gradient_target_bytes": sum(p.numel() * p.element_size() for _, p in targets),
        "worst_relative_difference": report["worst"],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
