"""Independent profiles run side by side, one worker process per CPU this process may use.

A fake-tensor profile is pure Python work on one core, and the profiles a closed form is fitted to do not depend
on each other (each builds a fresh model). On Linux the workers are forked from the asking process once its
imports are done, so they start at once, inherit the jobs (closures, never pickled) and send back only their
results; elsewhere, or with one worker, the jobs run here, one after the other. Either way the results are the
same and come back in the jobs' order.

A forked child may be unable to run autograd at all: once this process's autograd engine has started its device
threads (with a PyTorch built with CUDA, even without a GPU, a fake-tensor backward run here does), PyTorch refuses
autograd in every child forked afterwards. :func:`forked_autograd_works` asks a forked child before each run, and
where it cannot the jobs run here instead.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

T = TypeVar("T")

_JOBS: Sequence[Callable[[], Any]] = ()  # the jobs of the run in progress, inherited by its forked workers
_FORKED_AUTOGRAD_FAILED = False  # once refused, refused in every later child: the engine's threads stay started


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the system tells it, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _backward_or_exit_1() -> None:
    """In a forked child: one tiny backward; exit code 1 if PyTorch refuses autograd here."""
    import torch

    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:
        sys.exit(1)  # an int exit code: multiprocessing prints no traceback


def forked_autograd_works() -> bool:
    """Whether a child forked from this process now can run autograd (see the module's note), asked of one.

    A yes is asked again at each call (it holds until this process's next backward that starts the engine's
    threads); a no is kept for good.
    """
    global _FORKED_AUTOGRAD_FAILED
    if not _FORKED_AUTOGRAD_FAILED:
        child = multiprocessing.get_context("fork").Process(target=_backward_or_exit_1)
        child.start()
        child.join()
        _FORKED_AUTOGRAD_FAILED = child.exitcode != 0
    return not _FORKED_AUTOGRAD_FAILED


def _run(index: int) -> tuple[int, Any]:
    return index, _JOBS[index]()


def run_side_by_side(
    jobs: Sequence[Callable[[], T]],
    workers: int | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[T]:
    """``[job() for job in jobs]``, computed by up to ``workers`` forked processes (default: :func:`usable_cpus`),
    or here where a forked child could not run autograd (:func:`forked_autograd_works`).

    Jobs are handed out in order to whichever worker is free, so put the longest first. ``on_done(index)`` is
    called here as each job's result arrives. A job's exception is raised here, and a :class:`RuntimeError` if a
    worker dies (killed by the system, say) instead of waiting for it forever.
    """
    global _JOBS
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    count = min(workers or usable_cpus(), len(jobs))
    results: list[Any] = [None] * len(jobs)
    if count <= 1 or not sys.platform.startswith("linux") or not forked_autograd_works():
        for index, job in enumerate(jobs):
            results[index] = job()
            if on_done is not None:
                on_done(index)
        return results
    _JOBS = jobs
    try:
        with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_run, index) for index in range(len(jobs))]
            try:
                for future in as_completed(futures):
                    index, result = future.result()
                    results[index] = result
                    if on_done is not None:
                        on_done(index)
            except BaseException:
                for future in futures:  # what has not started yet will not
                    future.cancel()
                raise
    except BrokenProcessPool as error:
        raise RuntimeError(
            "a worker process died (killed, or out of memory?); run again with fewer workers "
            "(workers=1, or --jobs 1 on the command line)"
        ) from error
    finally:
        _JOBS = ()
    return results
