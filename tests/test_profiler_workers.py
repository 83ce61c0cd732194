import os
import signal
import subprocess
import sys
import time

import pytest

from hf_memo.profiler import workers
from hf_memo.profiler.workers import forked_autograd_works, run_side_by_side, usable_cpus


@pytest.fixture
def forking(monkeypatch):
    """Forked workers, as where children can run autograd (these jobs run none). An earlier test of this process
    may have made them unable to (see :func:`forked_autograd_works`), and the jobs would then run here."""
    monkeypatch.setattr(workers, "forked_autograd_works", lambda: True)


def _job(value, pause=0.0):
    def job():
        time.sleep(pause)
        return value, os.getpid()

    return job


def test_results_come_back_in_the_jobs_order_with_each_reported_once():
    done = []
    jobs = [_job(i, pause=0.05 * (4 - i)) for i in range(5)]  # the first ones finish last
    results = run_side_by_side(jobs, workers=2, on_done=done.append)
    assert [value for value, _ in results] == list(range(5))
    assert sorted(done) == list(range(5))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux only")
def test_jobs_run_in_forked_workers_and_one_worker_runs_them_here(forking):
    here = os.getpid()
    apart = run_side_by_side([_job(i, pause=0.05) for i in range(4)], workers=2)
    assert all(pid != here for _, pid in apart)
    assert {pid for _, pid in run_side_by_side([_job(i) for i in range(3)], workers=1)} == {here}


FAKE_BACKWARD_THEN_JOBS = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from hf_memo.profiler.workers import run_side_by_side

def job(seed):
    def run():
        x = torch.arange(3.0, requires_grad=True)
        (x * seed).sum().backward()
        return x.grad.tolist()
    return run

with FakeTensorMode():
    x = torch.empty(3, requires_grad=True)
    (x * 2).sum().backward()
print(run_side_by_side([job(i) for i in range(3)], workers=2))
"""


def test_jobs_that_run_autograd_come_back_after_a_fake_tensor_backward_here():
    """With a PyTorch built with CUDA, a fake-tensor backward leaves every child forked afterwards unable to run
    autograd: the jobs then run in the asking process, with the same results. In a process of its own, as that
    backward changes every later run of the process that ran it."""
    ran = subprocess.run([sys.executable, "-c", FAKE_BACKWARD_THEN_JOBS], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == str([[float(i)] * 3 for i in range(3)])


def test_where_forked_children_cannot_run_autograd_the_jobs_run_here(monkeypatch):
    monkeypatch.setattr(workers, "_FORKED_AUTOGRAD_FAILED", True)
    assert not forked_autograd_works()
    assert {pid for _, pid in run_side_by_side([_job(i) for i in range(3)], workers=2)} == {os.getpid()}


def test_a_jobs_error_is_raised_in_the_caller():
    def broken():
        raise ValueError("profile failed")

    with pytest.raises(ValueError, match="profile failed"):
        run_side_by_side([_job(0), broken], workers=2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux only")
def test_a_worker_that_dies_is_an_error_not_a_wait(forking):
    def killed():
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RuntimeError, match="a worker process died"):
        run_side_by_side([_job(0, pause=0.05), killed, _job(2)], workers=2)


def test_after_an_error_the_jobs_not_started_are_not_run(tmp_path):
    def broken():
        raise ValueError("first job failed")

    def mark(i):
        def run():
            time.sleep(0.05)  # a job takes time: on a loaded machine the error must still be seen before all ran
            (tmp_path / str(i)).touch()

        return run

    with pytest.raises(ValueError, match="first job failed"):
        run_side_by_side([broken, _job(1, pause=0.5)] + [mark(i) for i in range(20)], workers=2)
    assert len(list(tmp_path.iterdir())) < 20


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_bad_worker_counts_are_refused(workers):
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        run_side_by_side([_job(0)], workers=workers)


def test_usable_cpus_is_at_least_one():
    assert usable_cpus() >= 1
