"""hf_memo under PyTorch FSDP on 2 gloo processes: FSDP2 trains exactly like one unpatched process; FSDP1 with
``use_orig_params=False`` (parameters flattened out of the modules) is refused with a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

import hf_memo
from tests.conftest import VOCAB, build_model
from tests.multiprocess import run_processes

MODES = [("none", None), ("selective", None), ("memo", 0.5)]


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(rank))


def _patched(reference, recompute, alpha):
    extra = {} if alpha is None else {"offload_fraction": alpha}
    return hf_memo.apply(copy.deepcopy(reference), recompute=recompute, mlp_chunks=3, lm_head_chunks=2, **extra)


def _fsdp2_worker(rank: int, world_size: int) -> dict:
    results = {}
    for recompute, alpha in MODES:
        torch.manual_seed(0)
        model = _patched(build_model("llama", num_hidden_layers=2), recompute, alpha).train()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        ids = _batch(rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[recompute] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return results


def _fsdp1_worker(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = _patched(build_model("llama", num_hidden_layers=2), "none", None).train()
    model = FullyShardedDataParallel(model, use_orig_params=False, device_id=torch.device("cpu"))
    ids = _batch(rank)
    with pytest.raises(ValueError, match="use_orig_params=True") as error:
        model(input_ids=ids, labels=ids)
    return str(error.value)


def test_fsdp2_gradients_equal_one_unpatched_process_in_every_mode():
    torch.manual_seed(0)
    reference = build_model("llama", num_hidden_layers=2).train()
    for rank in range(2):  # FSDP averages the ranks' gradients
        ids = _batch(rank)
        (reference(input_ids=ids, labels=ids).loss / 2).backward()
    want = {name: p.grad for name, p in reference.named_parameters()}
    for recompute, grads in run_processes(_fsdp2_worker, 2)[0].items():
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-8, atol=1e-11, msg=f"{recompute}: {name}")


def test_fsdp1_with_flattened_parameters_is_refused_naming_use_orig_params():
    messages = run_processes(_fsdp1_worker, 2)
    assert all("FSDP2" in message for message in messages)
