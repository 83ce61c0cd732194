"""DeepSpeed ZeRO-3 is refused (hf_memo/zero3.py) wherever it shows, and ZeRO-2, the alternative named, is exact.

The DeepSpeed tests run DeepSpeed itself on CPU (``DS_ACCELERATOR=cpu``) over two gloo processes;
they are skipped where DeepSpeed is not installed (``DS_BUILD_OPS=0 pip install deepspeed``, part of the
test extra). Run them alone with ``python -m pytest -n 0 tests/test_zero3.py``.
"""

from __future__ import annotations

import os
import traceback
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainingArguments

import hf_memo
from hf_memo import MemoCallback
from hf_memo.integrations.accelerate import attach
from tests.conftest import build_model, make_batch
from tests.multiprocess import run_processes

ZERO3 = "hf_memo does not support DeepSpeed ZeRO stage 3"
MODES = {
    "none": {},
    "full": {"recompute": "full"},
    "selective": {"recompute": "selective"},
    "memo": {"recompute": "memo", "offload_fraction": 0.5},
}
CHUNKS = {"mlp_chunks": 3, "lm_head_chunks": 3}  # 13 tokens: chunks that do not divide S


def test_accelerate_launch_with_zero_stage_3_is_refused_at_apply(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    model = build_model("llama")
    with pytest.raises(ValueError, match=f"{ZERO3} \\(accelerate launch configures DeepSpeed with zero_stage: 3\\)"):
        hf_memo.apply(model)
    assert hf_memo.applied_config(model) is None
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    hf_memo.apply(model)  # ZeRO-2 keeps parameters whole


def test_an_accelerator_with_a_zero_3_plugin_is_refused_by_attach():
    model = hf_memo.apply(build_model("llama"), sequence_parallel_size=2)
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))
    accelerator = SimpleNamespace(distributed_type=None, num_processes=2, parallelism_config=None, state=state)
    with pytest.raises(ValueError, match=f"{ZERO3} \\(the Accelerator's DeepSpeedPlugin has zero_stage=3\\)"):
        attach(accelerator, model)


def test_transformers_deepspeed_config_with_stage_3_is_refused_at_apply_and_by_the_callback(tmp_path):
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    patched = hf_memo.apply(build_model("llama"))
    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})  # noqa: F841
    try:
        with pytest.raises(ValueError, match=f"{ZERO3} \\(transformers' DeepSpeed config sets"):
            hf_memo.apply(build_model("llama"))
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        with pytest.raises(ValueError, match="use DeepSpeed ZeRO stage 1 or 2 .* or FSDP2"):
            Trainer(model=patched, args=args, train_dataset=[], callbacks=[MemoCallback()])
    finally:
        unset_hf_deepspeed_config()


def _engine(model: torch.nn.Module, stage: int):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _batch(rank: int, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ranks of a sequence-parallel group see one batch; data-parallel ranks see their own."""
    return make_batch(1, 13, seed=5 if sp > 1 else 5 + rank)


def _error_of(action) -> str:
    try:
        action()
    except ValueError as error:
        return str(error)
    return "nothing raised"


def _deepspeed_worker(rank: int, world: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from deepspeed.utils import safe_get_full_grad

    results = {}
    for name, (memo, sp) in {**{m: (c, 1) for m, c in MODES.items()}, "memo sp=2": (MODES["memo"], 2)}.items():
        model = hf_memo.apply(build_model("llama", dtype=torch.float32), **memo, **CHUNKS, sequence_parallel_size=sp)
        try:
            engine = _engine(model, stage=2)
            ids, labels = _batch(rank, sp)
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
            results[name] = {"loss": loss.detach(), "grads": grads}
        except Exception:
            results[name] = {"error": traceback.format_exc()[-2000:]}
    ids, labels = _batch(rank, 1)
    patched_first = _engine(hf_memo.apply(build_model("llama", dtype=torch.float32), **CHUNKS), stage=3)
    results["zero3 forward"] = _error_of(lambda: patched_first(input_ids=ids, labels=labels))
    partitioned = _engine(build_model("llama", dtype=torch.float32), stage=3)
    results["zero3 apply"] = _error_of(lambda: hf_memo.apply(partitioned.module))
    return results


def _reference(world: int, sp: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Per-rank losses of the unpatched model and its gradients averaged over the ranks, as ZeRO averages them."""
    losses, total = [], {}
    for rank in range(world):
        model = build_model("llama", dtype=torch.float32)
        ids, labels = _batch(rank, sp)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        for name, param in model.named_parameters():
            total[name] = total.get(name, 0) + param.grad / world
    return losses, total


def test_zero_2_is_exact_in_every_mode_and_zero_3_is_refused_before_a_step(monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    per_rank = run_processes(_deepspeed_worker, 2)
    for rank, results in enumerate(per_rank):
        assert ZERO3 in results["zero3 forward"] and "DeepSpeed ZeRO stage 3" in results["zero3 forward"]
        assert "its parameters are partitioned by DeepSpeed ZeRO stage 3" in results["zero3 apply"]
        for name, got in ((n, r) for n, r in results.items() if not n.startswith("zero3")):
            assert "error" not in got, f"rank {rank}, {name}: {got.get('error')}"
            sp = 2 if "sp=2" in name else 1
            want_losses, want_grads = _reference(2, sp)
            # fp32 (DeepSpeed's ZeRO-2 optimizer keeps fp32 gradients): float tolerance
            torch.testing.assert_close(got["loss"], want_losses[rank], rtol=1e-5, atol=1e-6)
            for param, grad in want_grads.items():
                torch.testing.assert_close(
                    got["grads"][param], grad, rtol=1e-4, atol=1e-6, msg=lambda m, p=param, n=name: f"{n} {p}: {m}"
                )
