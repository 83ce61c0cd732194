"""The memo executor under DistributedDataParallel (2 CPU processes, gloo): gradients hooks see every parameter."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hf_memo
from tests.conftest import build_model, make_batch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
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
        torch.save({n: p.grad for n, p in model.named_parameters()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_averages_memo_gradients_like_unpatched_training(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    reference = build_model("llama", num_hidden_layers=4)
    for rank in range(2):
        ids, labels = make_batch(2, 13, seed=10 + rank)
        (reference(input_ids=ids, labels=labels).loss / 2).backward()
    for rank in range(2):
        grads = torch.load(tmp_path / f"rank{rank}.pt")
        for name, param in reference.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-8, atol=1e-11, msg=name)
