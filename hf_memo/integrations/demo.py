"""``hf-memo demo``: fine-tune a small Llama on CPU with hf_memo, beside plain Hugging Face, and compare."""

from __future__ import annotations

import argparse
import copy

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import hf_memo
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.memtracker import training_step_peak
from hf_memo.units import format_bytes

HELP = "Fine-tune a small Llama on CPU with hf_memo beside plain Hugging Face; print losses and peak memory."


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--seed", type=int, default=0)


def demo_config(seq_len: int) -> LlamaConfig:
    """A small Llama whose vocabulary and MLP are wide relative to its hidden size, like real LLMs."""
    return LlamaConfig(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=8192,
        max_position_embeddings=max(seq_len, 2048),
        tie_word_embeddings=False,
    )


def demo_memo_config() -> hf_memo.MemoConfig:
    """Chunk even the demo's short sequences, so the memory saving shows at CPU-friendly lengths."""
    return hf_memo.MemoConfig(min_chunk_tokens=128)


def markov_tokens(
    vocab: int, seq_len: int, steps: int, seed: int, states: int = 256, branching: int = 2
) -> torch.Tensor:
    """``(steps, seq_len)`` tokens from a fixed sparse Markov chain over ``states`` of the ``vocab`` ids.

    Learnable in a few steps (first which ids occur, then which follow which), so the loss falls.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=gen)[:states]
    successors = torch.randint(0, states, (states, branching), generator=gen)
    state = torch.randint(0, states, (steps,), generator=gen)
    tokens = torch.empty(steps, seq_len, dtype=torch.long)
    for t in range(seq_len):
        tokens[:, t] = ids[state]
        state = successors[state, torch.randint(0, branching, (steps,), generator=gen)]
    return tokens


def peak_bytes(config: LlamaConfig, seq_len: int, patched: bool) -> int:
    """Peak bytes of one training step, profiled on fake tensors (the same way for both models)."""
    model, mode = fake_causal_lm(config, torch.float32)
    with mode:
        if patched:
            hf_memo.apply(model, demo_memo_config())
        return training_step_peak(model, 1, seq_len).total


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.seq_len < 2:
        raise ValueError(f"--steps must be >= 1 and --seq-len >= 2, got {args.steps} and {args.seq_len}")
    torch.manual_seed(args.seed)
    config = demo_config(args.seq_len)
    plain = LlamaForCausalLM(config).train()
    memo = hf_memo.apply(copy.deepcopy(plain), demo_memo_config())
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=3e-3) for name, m in (("plain", plain), ("memo", memo))}
    data = markov_tokens(config.vocab_size, args.seq_len, args.steps, args.seed)
    print(
        f"Small Llama ({sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M parameters), "
        f"{args.steps} steps of {args.seq_len} tokens, fp32 on CPU; plain Hugging Face and hf_memo side by side."
    )
    losses = {"plain": [], "memo": []}
    bar = tqdm(range(args.steps), desc="fine-tuning", unit="step")
    for step in bar:
        ids = data[step : step + 1]
        for name, model in (("plain", plain), ("memo", memo)):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            losses[name].append(loss.item())
        bar.write(f"step {step + 1:3d}  loss plain HF {losses['plain'][-1]:.4f}  hf_memo {losses['memo'][-1]:.4f}")
    drift = max(abs(a - b) for a, b in zip(losses["plain"], losses["memo"]))
    print(
        f"\nLoss: {losses['memo'][0]:.4f} -> {losses['memo'][-1]:.4f}; "
        f"largest per-step difference from plain HF {drift:.2e}"
    )

    print("\nPeak memory of one training step (fake-tensor profile, fp32, batch 1):")
    print(f"{'seq len':>9} | {'plain HF':>12} | {'hf_memo':>12} | ratio")
    for seq_len in sorted({args.seq_len, 16384, 65536}):
        plain_peak = peak_bytes(config, seq_len, patched=False)
        memo_peak = peak_bytes(config, seq_len, patched=True)
        print(
            f"{seq_len:>9,} | {format_bytes(plain_peak):>12} | {format_bytes(memo_peak):>12} | "
            f"{plain_peak / memo_peak:.1f}x"
        )
    return 0
