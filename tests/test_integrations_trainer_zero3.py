"""The Trainer with ``TrainingArguments(deepspeed=<ZeRO-3 dict>)`` and :class:`hf_memo.MemoCallback`.

Two gloo processes on CPU (``DS_ACCELERATOR=cpu``): the Trainer builds Accelerate's ``DeepSpeedPlugin`` from the
dict and DeepSpeed's engine from it. hf_memo's run (memo executor, mini-sequence MLP and LM head) logs the same
losses as the unpatched model's under the same config, and the weights ``trainer.save_model`` consolidates from
the ZeRO-3 partitions load into a plain model (no DeepSpeed) equal to the unpatched run's.
"""

from __future__ import annotations

import os

import pytest
import torch

import hf_memo
from tests.conftest import build_model, make_batch
from tests.multiprocess import run_processes

pytest.importorskip("deepspeed")

DEEPSPEED = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
}
MEMO = {"recompute": "memo", "offload_fraction": 0.5, "mlp_chunks": 3, "lm_head_chunks": 3}


def _rows() -> list[dict[str, torch.Tensor]]:
    """8 rows of 13 tokens: 2 steps x 2 accumulated micro-batches x 2 ranks."""
    rows = []
    for seed in range(8):
        ids, labels = make_batch(1, 13, seed=seed)
        rows.append({"input_ids": ids[0], "labels": labels[0]})
    return rows


def _train(output_dir: str, patched: bool) -> list[float]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=output_dir,
        deepspeed=DEEPSPEED,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=0.5,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    model = build_model("llama", dtype=torch.float32)
    callbacks = []
    if patched:
        hf_memo.apply(model, **MEMO)
        callbacks.append(hf_memo.MemoCallback())
    trainer = Trainer(model=model, args=args, train_dataset=_rows(), callbacks=callbacks)
    trainer.train()
    assert trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    assert all(hasattr(p, "ds_id") for p in trainer.model_wrapped.module.parameters())
    trainer.save_model(output_dir)
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _worker(rank: int, world: int, folder: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    return {name: _train(os.path.join(folder, name), name == "hf_memo") for name in ("unpatched", "hf_memo")}


def test_trainer_with_a_zero3_deepspeed_dict_and_the_callback_is_exact_and_saves_a_plain_checkpoint(
    monkeypatch, tmp_path
):
    from transformers import LlamaForCausalLM

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    per_rank = run_processes(_worker, 2, str(tmp_path))
    for losses in per_rank:
        assert len(losses["hf_memo"]) == 2
        torch.testing.assert_close(losses["hf_memo"], losses["unpatched"], rtol=1e-5, atol=0)
    initial = build_model("llama", dtype=torch.float32).state_dict()
    want = LlamaForCausalLM.from_pretrained(tmp_path / "unpatched", dtype=torch.float32).state_dict()
    got = LlamaForCausalLM.from_pretrained(tmp_path / "hf_memo", dtype=torch.float32).state_dict()
    assert got.keys() == want.keys() == initial.keys()
    for name, weight in want.items():
        assert not torch.equal(weight, initial[name]) or "norm" in name, f"{name} did not train"
        error, scale = (got[name] - weight).abs().max().item(), weight.abs().max().item()
        assert error <= 1e-5 * scale, f"{name}: |diff| {error:.3g} vs max |weight| {scale:.3g}"
