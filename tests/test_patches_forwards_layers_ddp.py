"""The memo executor under DistributedDataParallel (2 CPU processes, gloo): gradients hooks see every parameter."""

import torch

import hf_memo
from tests.conftest import build_model, make_batch
from tests.multiprocess import run_processes


def _worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    # DDP lives only in this function: run_processes destroys the process group after it returns, so the
    # DDP reducer never holds the group's last reference (its destructor would join gloo's threads
    # with the GIL held, a deadlock in torch).
    model = hf_memo.apply(
        build_model("llama", num_hidden_layers=4),
        recompute="memo",
        offload_fraction=0.5,
        mlp_chunks=4,
        lm_head_chunks=2,
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ids, labels = make_batch(2, 13, seed=10 + rank)
    ddp(input_ids=ids, labels=labels).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_ddp_averages_memo_gradients_like_unpatched_training():
    results = run_processes(_worker, 2)
    reference = build_model("llama", num_hidden_layers=4)
    for rank in range(2):
        ids, labels = make_batch(2, 13, seed=10 + rank)
        (reference(input_ids=ids, labels=labels).loss / 2).backward()
    for grads in results:
        for name, param in reference.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-8, atol=1e-11, msg=name)
