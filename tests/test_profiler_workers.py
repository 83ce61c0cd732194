import os
import signal
import sys
import time

import pytest

from hf_memo.profiler.workers import run_side_by_side, usable_cpus


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
def test_jobs_run_in_forked_workers_and_one_worker_runs_them_here():
    here = os.getpid()
    apart = run_side_by_side([_job(i, pause=0.05) for i in range(4)], workers=2)
    assert all(pid != here for _, pid in apart)
    assert {pid for _, pid in run_side_by_side([_job(i) for i in range(3)], workers=1)} == {here}


def test_a_jobs_error_is_raised_in_the_caller():
    def broken():
        raise ValueError("profile failed")

    with pytest.raises(ValueError, match="profile failed"):
        run_side_by_side([_job(0), broken], workers=2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux only")
def test_a_worker_that_dies_is_an_error_not_a_wait():
    def killed():
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RuntimeError, match="a worker process died"):
        run_side_by_side([_job(0, pause=0.05), killed, _job(2)], workers=2)


def test_after_an_error_the_jobs_not_started_are_not_run(tmp_path):
    def broken():
        raise ValueError("first job failed")

    def mark(i):
        return lambda: (tmp_path / str(i)).touch()

    with pytest.raises(ValueError, match="first job failed"):
        run_side_by_side([broken, _job(1, pause=0.5)] + [mark(i) for i in range(20)], workers=2)
    assert len(list(tmp_path.iterdir())) < 20


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_bad_worker_counts_are_refused(workers):
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        run_side_by_side([_job(0)], workers=workers)


def test_usable_cpus_is_at_least_one():
    assert usable_cpus() >= 1
