"""``hf-memo demo``: fine-tune a small Llama on the LongAlpaca sample on CPU, with hf_memo and with plain Hugging Face.

Both runs use the ``Trainer`` from the same seed on the same packed rows (the sample's records in the
Llama-2 chat format, the loss on the answers only, concatenated into rows of ``--seq-len`` tokens).
hf_memo's run uses :class:`~hf_memo.integrations.trainer.MemoCallback` with the memo executor, which
plans memory before the first step and writes the plan. Afterwards one training step of each setup
is profiled the same way, on fake tensors (CPU has no peak-memory counter), at the demo's length and
longer ones; the table compares the peaks and a plot shows the memory timeline of one step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback
from transformers.utils import logging as hf_logging

from hf_memo.config import MemoConfig
from hf_memo.data import LONGALPACA_SAMPLE, LONGALPACA_TOKENIZER
from hf_memo.integrations.trainer import ALPHA, HOST_OFFLOAD, TOKENS_PER_SECOND, MemoCallback
from hf_memo.patches.apply import apply
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.plot import plot_timelines
from hf_memo.profiler.step import trace_training_step
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.units import format_bytes

PLOT_FILE = "memory_timeline.png"
IGNORE = -100
LONGER = (4, 16)  # the table's other lengths, as multiples of --seq-len


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("hf_memo_demo"), help="default ./hf_memo_demo")
    parser.add_argument(
        "--data", type=Path, default=LONGALPACA_SAMPLE, help="LongAlpaca JSON records (default: the shipped sample)"
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=LONGALPACA_TOKENIZER, help="tokenizer directory (default: the sample's)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (default 1: the small model gains little from more)"
    )


def demo_config(vocab_size: int, seq_len: int) -> LlamaConfig:
    """A small Llama whose vocabulary and MLP are wide relative to its hidden size, like real LLMs."""
    return LlamaConfig(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
    )


def demo_memo_config() -> MemoConfig:
    """The memo executor, half of the tokens offloaded, a greedy memory plan (seconds); chunks even at demo lengths."""
    return MemoConfig(recompute="memo", offload_fraction=0.5, planner="greedy", min_chunk_tokens=128)


def packed_rows(records: list[dict], tokenizer: PreTrainedTokenizerBase, seq_len: int) -> tuple[torch.Tensor, ...]:
    """``(input_ids, labels)``, each ``(rows, seq_len)``: records as ``<s>[INST] instruction [/INST] output</s>``,
    labels -100 on the prompt, concatenated and cut into full rows. The remainder, and rows without an
    answer token (rows shorter than a record can fall inside a prompt), are dropped."""

    def tokens(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids: list[int] = []
    labels: list[int] = []
    for record in records:
        prompt = [tokenizer.bos_token_id] + tokens("[INST] ") + tokens(record["instruction"]) + tokens(" [/INST] ")
        answer = tokens(record["output"]) + [tokenizer.eos_token_id]
        ids += prompt + answer
        labels += [IGNORE] * len(prompt) + answer
    rows = len(ids) // seq_len
    if rows == 0:
        raise ValueError(f"the data has {len(ids)} tokens, fewer than --seq-len {seq_len}")
    shape = (rows, seq_len)
    ids_rows, label_rows = (
        torch.tensor(ids[: rows * seq_len]).view(shape),
        torch.tensor(labels[: rows * seq_len]).view(shape),
    )
    learns = (label_rows[:, 1:] != IGNORE).any(dim=1)
    return ids_rows[learns], label_rows[learns]


class Rows(Dataset):
    """Rows of ``input_ids`` and ``labels`` for the Trainer."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


class StepPrinter(TrainerCallback):
    """A progress bar over the steps and one line per step: the loss, and the reference loss if given."""

    def __init__(self, label: str, steps: int, reference: list[float] | None = None) -> None:
        self.label, self.steps, self.reference = label, steps, reference
        self.losses: list[float] = []
        self.bar: tqdm | None = None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.bar = tqdm(total=self.steps, desc=self.label, unit="step")

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if not logs or "loss" not in logs:
            return
        self.losses.append(logs["loss"])
        line = f"  step {state.global_step:3d}/{self.steps}  loss {logs['loss']:.4f}"
        if TOKENS_PER_SECOND in logs:
            line += f"  {logs[TOKENS_PER_SECOND]:8,.0f} tokens/s"
        if ALPHA in logs:
            line += f"  alpha {logs[ALPHA]:.2f}  host {format_bytes(int(logs[HOST_OFFLOAD] * 2**30))}"
        if self.reference is not None:
            other = self.reference[len(self.losses) - 1]
            line += f"  (hf_memo {other:.4f}, difference {abs(logs['loss'] - other):.1e})"
        self.bar.write(line)
        self.bar.update(1)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self.bar.close()


def train(
    model: LlamaForCausalLM, rows: Rows, args: argparse.Namespace, out: Path, callbacks: list[TrainerCallback]
) -> Trainer:
    training = TrainingArguments(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=1,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = Trainer(model=model, args=training, train_dataset=rows, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # StepPrinter prints the steps
    trainer.train()
    return trainer


def step_trace(config: LlamaConfig, seq_len: int, memo: bool) -> AllocationTrace:
    """Allocation trace of one training step (fp32, batch 1, AdamW) on fake tensors."""
    model, session = fake_causal_lm(config, torch.float32)
    with session:
        if memo:
            apply(model, demo_memo_config().replace(planner="off", host_memory_limit=2**50))
        return trace_training_step(model, 1, seq_len)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.seq_len < 16 or args.threads < 1:
        raise ValueError(
            f"--steps and --threads must be >= 1 and --seq-len >= 16, "
            f"got {args.steps}, {args.threads} and {args.seq_len}"
        )
    for name, path in (("--data", args.data), ("--tokenizer", args.tokenizer)):
        if not path.exists():
            raise FileNotFoundError(f"{name} {path} does not exist (the shipped sample is {LONGALPACA_SAMPLE.parent})")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # small matmuls gain little from threads; spinning ones stall a busy CPU
    try:
        return _demo(args)
    finally:
        torch.set_num_threads(threads)


def _demo(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    input_ids, labels = packed_rows(json.loads(args.data.read_text()), tokenizer, args.seq_len)
    rows = Rows(input_ids, labels)
    config = demo_config(len(tokenizer), args.seq_len)
    torch.manual_seed(args.seed)
    initial = LlamaForCausalLM(config).state_dict()
    print(
        f"Small Llama ({sum(t.numel() for t in initial.values()) / 1e6:.1f}M parameters, fp32) fine-tuned on CPU for "
        f"{args.steps} steps on {len(rows)} packed rows of {args.seq_len:,} tokens from {args.data.name} "
        "(LongAlpaca format, loss on the answers), first with hf_memo, then with plain Hugging Face."
    )

    def fresh_model() -> LlamaForCausalLM:
        model = LlamaForCausalLM(config)
        model.load_state_dict(initial)
        return model

    callback = MemoCallback(demo_memo_config())
    memo_printer = StepPrinter("hf_memo (memo executor)", args.steps)
    train(fresh_model(), rows, args, args.output_dir, [callback, memo_printer])
    plain_printer = StepPrinter("plain Hugging Face", args.steps, reference=memo_printer.losses)
    train(fresh_model(), rows, args, args.output_dir / "plain-hf", [plain_printer])
    drift = max(abs(a - b) for a, b in zip(memo_printer.losses, plain_printer.losses))

    print("\nPeak memory of one training step, both profiled the same way (fake tensors, fp32, batch 1, AdamW):")
    print(f"{'seq len':>9} | {'plain HF':>11} | {'hf_memo device':>14} | {'hf_memo host':>12} | plain HF / hf_memo")
    traces = {}
    for seq_len in [args.seq_len] + [args.seq_len * k for k in LONGER]:
        plain = step_trace(config, seq_len, memo=False)
        memo = step_trace(config, seq_len, memo=True)
        traces.setdefault("plain", plain), traces.setdefault("memo", memo)
        plain_peak, memo_peak, host = peak(plain).total, peak(memo).total, peak(memo, "host").total
        print(
            f"{seq_len:>9,} | {format_bytes(plain_peak):>11} | {format_bytes(memo_peak):>14} | "
            f"{format_bytes(host):>12} | {plain_peak / memo_peak:.1f}x"
        )
    plot = args.output_dir / PLOT_FILE
    plot_timelines(
        {"plain Hugging Face": traces["plain"], "hf_memo (memo executor, alpha 0.5)": traces["memo"]},
        plot,
        f"One training step of the demo's Llama at {args.seq_len:,} tokens (fake-tensor profile, fp32)",
    )
    losses = memo_printer.losses
    print(
        f"\nLoss {losses[0]:.4f} -> {losses[-1]:.4f}; largest per-step difference between hf_memo and plain HF "
        f"{drift:.1e}"
    )
    print(f"Memory plan ({callback.plan_source}): {callback.plan_path}")
    print(f"Memory plot: {plot}")
    print(f"Done in {time.perf_counter() - began:.0f} s.")
    return 0
