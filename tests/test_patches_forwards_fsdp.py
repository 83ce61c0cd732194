"""hf_memo under PyTorch FSDP on 2 gloo processes: FSDP2 trains exactly like one unpatched process (a
mixture-of-experts model with its router aux loss too); FSDP1 with ``use_orig_params=False`` (parameters flattened
out of the modules) is refused with a clear error on every rank, before any layer's collective (the Trainer
callback: before any collective at all)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

import hf_memo
from tests.conftest import VOCAB, build_model
from tests.model_catalog import build_catalog_model
from tests.multiprocess import run_processes

MODES = [("none", None), ("selective", None), ("memo", 0.5)]
MOE = "qwen3_moe"  # router logits on, router_aux_loss_coef 0.25
MOE_MODES = [("none", None), ("full", None), ("memo", 1.0)]


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


def _fsdp2_moe_worker(rank: int, world_size: int) -> dict:
    results = {}
    for recompute, alpha in MOE_MODES:
        model = _patched(build_catalog_model(MOE), recompute, alpha)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        ids = _batch(rank)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        results[recompute] = {"loss": out.loss.detach(), "aux_loss": out.aux_loss.detach(), "grads": grads}
    return results


class _AllGathers:
    """Counts FSDP1's all-gathers (``torch.distributed.all_gather_into_tensor``) while active."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> _AllGathers:
        self._original = torch.distributed.all_gather_into_tensor

        def counted(*args, **kwargs):
            self.count += 1
            return self._original(*args, **kwargs)

        torch.distributed.all_gather_into_tensor = counted
        return self

    def __exit__(self, *exc) -> None:
        torch.distributed.all_gather_into_tensor = self._original


def _fsdp1_worker(rank: int, world_size: int) -> dict:
    """FSDP1 without use_orig_params, every layer a unit of its own and the model the root: the callback refuses it
    before any all-gather; a forward refuses it at the patched model's entry, after only the root's all-gather."""
    from types import SimpleNamespace

    from hf_memo import MemoCallback

    torch.manual_seed(0)
    model = _patched(build_model("llama", num_hidden_layers=2), "memo", 0.5).train()
    for index, layer in enumerate(model.model.layers):
        model.model.layers[index] = FullyShardedDataParallel(
            layer, use_orig_params=False, device_id=torch.device("cpu")
        )
    model = FullyShardedDataParallel(model, use_orig_params=False, device_id=torch.device("cpu"))
    ids = _batch(rank)
    messages = {}
    with _AllGathers() as gathers, pytest.raises(ValueError, match="use_orig_params=True") as error:
        MemoCallback(progress=False).on_train_begin(SimpleNamespace(), None, None, model=model)
    messages["callback"] = (str(error.value), gathers.count)
    with _AllGathers() as gathers, pytest.raises(ValueError, match="use_orig_params=True") as error:
        model(input_ids=ids, labels=ids)
    messages["forward"] = (str(error.value), gathers.count)
    return messages


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


def test_fsdp2_moe_model_with_its_router_aux_loss_equals_one_unpatched_process():
    reference = build_catalog_model(MOE)
    wants = []
    for rank in range(2):
        ids = _batch(rank)
        want = reference(input_ids=ids, labels=ids)
        (want.loss / 2).backward()
        wants.append(want)
    per_rank = run_processes(_fsdp2_moe_worker, 2)  # FSDP2 swaps in a subclass of its own: the aux loss is found
    for rank, results in enumerate(per_rank):
        for recompute, got in results.items():
            for output in ("loss", "aux_loss"):
                torch.testing.assert_close(
                    got[output], getattr(wants[rank], output).detach(), rtol=1e-6, atol=0, msg=f"{recompute}: {output}"
                )
            for name, param in reference.named_parameters():
                torch.testing.assert_close(
                    got["grads"][name], param.grad, rtol=1e-8, atol=1e-11, msg=f"rank {rank}, {recompute}: {name}"
                )


def test_fsdp1_with_flattened_parameters_is_refused_on_every_rank_before_the_layers_collectives():
    for messages in run_processes(_fsdp1_worker, 2):
        assert "the Trainer's model wrapped by FSDP1" in messages["callback"][0] and messages["callback"][1] == 0
        assert "parameters flattened at a training forward" in messages["forward"][0]
        assert messages["forward"][1] <= 1  # the root unit's own all-gather, before the patched forward runs
