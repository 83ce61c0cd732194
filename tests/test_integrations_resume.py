"""Resuming a preempted run gives the run that was never interrupted: Trainer ``resume_from_checkpoint`` and
Accelerate ``save_state`` / ``load_state``, in every recompute mode, with LoRA and dropout on (fp32).

hf_memo keeps no training state of its own in a checkpoint: the memory policy, calibration and host buffers are
decided again on the resumed run's first step (they are functions of the model, the shape and the machine, not of
the training so far), and the callback's plan cache (``<output_dir>/hf_memo_plan.json``) is reused when it was
made for the same shape, model, trainable parameters, adapters and hf_memo config.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

import hf_memo
from hf_memo import MemoCallback, MemoConfig
from tests.conftest import build_model
from tests.test_integrations_trainer import TokenRows, make_trainer, one_thread, train_losses  # noqa: F401

MODES = {
    "none": MemoConfig(mlp_chunks=3, lm_head_chunks=2),
    "full": MemoConfig(recompute="full", mlp_chunks=3, lm_head_chunks=2),
    "selective": MemoConfig(recompute="selective", mlp_chunks=3, lm_head_chunks=2),
    "memo": MemoConfig(recompute="memo", offload_fraction=0.5, mlp_chunks=3, lm_head_chunks=2, planner="greedy"),
}


def _lora_model() -> torch.nn.Module:
    """A float32 LoRA model with attention dropout and LoRA dropout on."""
    base = build_model("llama", dtype=torch.float32, num_hidden_layers=3, attention_dropout=0.1)
    config = LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(base, config)


def _trainable(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", list(MODES))
def test_trainer_resume_from_checkpoint_equals_the_uninterrupted_run(mode, tmp_path):
    initial = _lora_model()
    whole = make_trainer(
        tmp_path,
        model=copy.deepcopy(initial),
        steps=4,
        callbacks=[MemoCallback(MODES[mode], progress=False)],
        save_strategy="steps",
        save_steps=2,
    )
    whole.train()
    resumed = make_trainer(
        tmp_path,
        model=copy.deepcopy(initial),
        steps=4,
        callbacks=[MemoCallback(MODES[mode], progress=False)],
        save_strategy="no",
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert hf_memo.applied_config(resumed.model) == MODES[mode]
    assert train_losses(resumed) == train_losses(whole)  # steps 1-2 from the checkpoint's state, 3-4 bit for bit
    want = _trainable(whole.model)
    for name, value in _trainable(resumed.model).items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    if mode == "memo":
        assert (tmp_path / "hf_memo_plan.json").is_file()


def _accelerate_steps(model, accelerator, batches, optimizer, steps: int) -> list[float]:
    losses = []
    for _, batch in zip(range(steps), batches):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _accelerated(initial, mode):
    accelerator = Accelerator(cpu=True)
    model = hf_memo.apply(copy.deepcopy(initial), MODES[mode])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    # The loader's own generator: opening a new iterator otherwise draws from the global RNG, which shifts every
    # later dropout mask by one draw (with or without hf_memo).
    loader = DataLoader(TokenRows(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    return accelerator, *accelerator.prepare(model, optimizer, loader)


@pytest.mark.parametrize("mode", ["none", "memo"])
def test_accelerate_save_state_and_load_state_resume_exactly(mode, tmp_path):
    initial = _lora_model()
    torch.manual_seed(5)
    accelerator, model, optimizer, loader = _accelerated(initial, mode)
    batches = iter(loader)
    first = _accelerate_steps(model, accelerator, batches, optimizer, 2)
    accelerator.save_state(str(tmp_path / "state"))
    rest = _accelerate_steps(model, accelerator, batches, optimizer, 2)
    want = _trainable(model)

    torch.manual_seed(123)  # the resumed process starts from another RNG state: load_state restores it
    accelerator, model, optimizer, loader = _accelerated(initial, mode)
    accelerator.load_state(str(tmp_path / "state"))
    resumed = _accelerate_steps(model, accelerator, iter(accelerator.skip_first_batches(loader, 2)), optimizer, 2)
    assert len(first) == 2 and resumed == rest
    for name, value in _trainable(model).items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
