"""A few Trainer steps of a tiny float64 Llama with hf_memo, on CPU; writes the losses and final weights.

    accelerate launch --config_file examples/accelerate_configs/cpu_2proc_sp.yaml \\
        tests/scripts/sequence_parallel_trainer.py --sequence-parallel 2 --out result.pt
    python tests/scripts/sequence_parallel_trainer.py --sequence-parallel 1 --out reference.pt

Both runs see the same batches in the same order (one data-parallel replica), so with exact
sequence parallelism their losses and weights agree to rounding.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import hf_memo
from hf_memo.integrations.accelerate import attach

SEQ_LEN = 37  # odd: the sequence-parallel run pads it


def samples(count: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (SEQ_LEN,), generator=generator)
        labels = ids.clone()
        labels[: SEQ_LEN // 4] = -100  # a prompt without loss, as in supervised fine-tuning
        data.append({"input_ids": ids, "labels": labels})
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequence-parallel", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            use_cpu=True,
            per_device_train_batch_size=2,
            max_steps=args.steps,
            learning_rate=0.05,
            optim="sgd",
            lr_scheduler_type="constant",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=0,
            disable_tqdm=True,
        )
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=101,
            hidden_size=32,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
        model = LlamaForCausalLM(config).to(torch.float64)
        hf_memo.apply(model, sequence_parallel_size=args.sequence_parallel, mlp_chunks=2, lm_head_chunks=3)
        trainer = Trainer(model=model, args=training_args, train_dataset=samples(12, config.vocab_size))
        if args.sequence_parallel > 1:
            attach(trainer.accelerator, trainer.model)
        trainer.train()
        if trainer.accelerator.is_main_process:
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            weights = {name: p.detach().clone() for name, p in hf_memo.patches.causal_lm_of(model).named_parameters()}
            torch.save({"losses": losses, "weights": weights, "world": trainer.accelerator.num_processes}, args.out)


if __name__ == "__main__":
    main()
