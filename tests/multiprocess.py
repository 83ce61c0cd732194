"""Run a function on several CPU processes joined by a gloo process group, and collect what each returns."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, worker: Callable, world_size: int, folder: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    try:
        result = worker(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(folder) / f"result-{rank}.pt")


def run_processes(worker: Callable, world_size: int, *args: Any) -> list[Any]:
    """``[worker(rank, world_size, *args) for rank in range(world_size)]``, each in its own process.

    ``worker`` must be a module-level function (it is pickled by reference); it runs with the
    default process group initialized (gloo over a file store, so parallel test runs never collide
    on ports) and its return value must be picklable by ``torch.save``. An exception in any process
    fails the call with that process's traceback.
    """
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the children's; 2 cores shared by several processes
    try:
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(_entry, args=(worker, world_size, folder, args), nprocs=world_size, join=True)
            return [torch.load(Path(folder) / f"result-{rank}.pt", weights_only=False) for rank in range(world_size)]
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = threads
