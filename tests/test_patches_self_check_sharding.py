"""The self-check on parameters FSDP2 or DeepSpeed ZeRO-3 shard (hf_memo/patches/self_check_sharding.py), on 2 gloo
processes: it runs with the parameters they gather, compares the gradients of the probed layers' own parameters,
leaves the step's gradients as they would be without it, and refuses on every rank a fault that only one rank's
probe sees, before any gradient exists (no rank waits on a collective the others skip)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.fsdp import fully_shard

import hf_memo
from hf_memo.patches import self_check
from hf_memo.patches.apply import causal_lm_of
from hf_memo.patches.patching import patch_state
from tests.conftest import VOCAB, build_model
from tests.multiprocess import run_processes


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(rank))


def _spy_on_gradients(compared: list[list[str]]) -> None:
    """Records the names of the gradients each probe pass computes."""
    run = self_check._run

    def spied(*args):
        result = run(*args)
        compared.append(sorted(name for name, g in result.gradients.items() if g is not None))
        return result

    self_check._run = spied


def _fault_on_rank_one(model: torch.nn.Module, rank: int) -> None:
    """Layer 1's mini-sequence MLP off by 5% on rank 1 only (beyond fp32's rounding as well)."""
    if rank == 1:
        installed = patch_state(causal_lm_of(model)).structure.layers[1].mlp.forward
        impl = installed.impl
        installed.impl = lambda *args: impl(*args) * 1.05


def _fsdp2_step(rank: int, recompute: str, fault: bool) -> dict:
    compared: list[list[str]] = []
    _spy_on_gradients(compared)
    torch.manual_seed(0)
    model = hf_memo.apply(build_model("llama", num_hidden_layers=2), recompute=recompute, mlp_chunks=3).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if fault:
        _fault_on_rank_one(model, rank)
    ids = _batch(rank)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except self_check.SelfCheckError as error:
        return {"error": str(error), "grads": [p.grad for p in model.parameters()], "compared": compared}
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return {"grads": grads, "compared": compared, "checked": patch_state(model).self_check.checked}


def _fsdp2_worker(rank: int, world_size: int) -> dict:
    run = self_check._run
    results = {}
    for recompute, fault in (("full", False), ("memo", False), ("full", True)):
        self_check._PASSED.clear()  # each configuration checked afresh
        results[recompute, fault] = _fsdp2_step(rank, recompute, fault)
        self_check._run = run
    return results


def test_under_fsdp2_the_check_compares_gathered_gradients_and_refuses_on_every_rank_what_one_rank_finds():
    """The check compares the gradients of the probed layers' own parameters (gathered by FSDP2), and leaves the
    step's gradients equal to one unpatched process's; a fault only rank 1's probe sees (layer 1's MLP) is refused on
    both ranks, naming the layer on rank 1, before any gradient exists."""
    torch.manual_seed(0)
    reference = build_model("llama", num_hidden_layers=2).train()
    for rank in range(2):  # FSDP averages the ranks' gradients
        ids = _batch(rank)
        (reference(input_ids=ids, labels=ids).loss / 2).backward()
    per_rank = run_processes(_fsdp2_worker, 2)
    for results in per_rank:
        for recompute in ("full", "memo"):
            result = results[recompute, False]
            assert result["checked"] == {"plain"}
            assert len(result["compared"]) == 2  # the unpatched and the patched pass
            for names in result["compared"]:
                assert "decoder layer 0 (FSDPLlamaDecoderLayer): mlp.down_proj.weight" in names
                assert "the LM head: weight" in names and "the final norm: weight" in names
            for name, p in reference.named_parameters():
                torch.testing.assert_close(result["grads"][name], p.grad, rtol=1e-8, atol=1e-11, msg=name)
    rank0, rank1 = (results["full", True] for results in per_rank)
    assert "its MLP (LlamaMLP) run in mini-sequences differs" in rank1["error"]
    assert "decoder layer 1 (FSDPLlamaDecoderLayer)'s output" in rank1["error"]
    assert "the probe on another rank" in rank0["error"]
    assert all(g is None for g in rank0["grads"] + rank1["grads"])


def _zero3_step(rank: int, recompute: str, fault: bool) -> dict:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    compared: list[list[str]] = []
    _spy_on_gradients(compared)
    model = hf_memo.apply(build_model("llama", dtype=torch.float32), recompute=recompute, mlp_chunks=3)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    if fault:
        _fault_on_rank_one(engine.module, rank)
    ids = _batch(rank)[:1]
    try:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
    except self_check.SelfCheckError as error:
        return {"error": str(error), "compared": compared}
    return {"compared": compared, "checked": patch_state(causal_lm_of(engine.module)).self_check.checked}


def _zero3_worker(rank: int, world_size: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    run = self_check._run
    results = {}
    for recompute, fault in (("memo", False), ("full", True)):
        self_check._PASSED.clear()
        results[recompute, fault] = _zero3_step(rank, recompute, fault)
        self_check._run = run
    return results


def test_under_zero3_the_check_compares_the_gathered_parameters_gradients_and_refuses_on_every_rank(monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    per_rank = run_processes(_zero3_worker, 2)
    for results in per_rank:
        result = results["memo", False]
        assert result["checked"] == {"plain"} and len(result["compared"]) == 2
        for names in result["compared"]:
            assert "decoder layer 0 (LlamaDecoderLayer): self_attn.q_proj.weight" in names
            assert "the LM head: weight" in names
    rank0, rank1 = (results["full", True] for results in per_rank)
    assert "decoder layer 1 (LlamaDecoderLayer)'s output" in rank1["error"]
    assert "the probe on another rank" in rank0["error"]
