"""The estimator's on-disk cache of fits: a cached answer is the cold one, a changed key misses, writers at once
leave one whole entry."""

import json
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest

from hf_memo.estimator import estimate as estimate_module
from hf_memo.estimator import fit_cache
from hf_memo.estimator.estimate import estimate
from hf_memo.estimator.fit_cache import FitCache, cache_dir
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.workers import run_side_by_side
from tests.test_profiler_step import CONFIGS

MiB = 2**20


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    CONFIGS["llama"](4).save_pretrained(folder)
    return str(folder / "config.json")


@pytest.fixture
def fresh_process(monkeypatch):
    """Nothing fitted in this process (as in a new run); the profile batches run from here on are recorded."""
    monkeypatch.setattr(fit_cache, "PROCESS_FITS", {})
    ran = []

    def recording(jobs, workers=None, on_done=None):
        ran.append(len(jobs))
        return run_side_by_side(jobs, workers, on_done)

    monkeypatch.setattr(estimate_module, "run_side_by_side", recording)
    return ran


def _no_profiles(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a cached answer profiled a step")

    monkeypatch.setattr(StepProfiler, "trace", refuse)
    monkeypatch.setattr(StepProfiler, "model", refuse)


# One question, its budgets as the command line passes them (no reserves, pinned memory given)
# (2,048 tokens in 12 MiB: memo's own policy is chosen and profiled, in half the time of 4,096 in 24 MiB)
QUESTION = dict(gpu_memory=12 * MiB, host_memory=64 * MiB, pinned_memory=64 * MiB, modes=["hf", "memo"])
FLAGS = ["--seq-len", "2k", "--gpu-memory", "12MiB", "--host-memory", "64MiB", "--pinned-memory", "64MiB"]
FLAGS += ["--reserve", "0GiB", "--host-reserve", "0GiB", "--modes", "hf,memo", "--json"]


@pytest.fixture(scope="module")
def cold(config_path, tmp_path_factory):
    """The question answered cold into a cache of its own (its folder, as $HF_MEMO_CACHE_DIR/estimator would be),
    the answer, and the profile batches it ran."""
    folder = tmp_path_factory.mktemp("cache") / "estimator"
    ran = []

    def recording(jobs, workers=None, on_done=None):
        ran.append(len(jobs))
        return run_side_by_side(jobs, workers, on_done)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fit_cache, "PROCESS_FITS", {})
        patch.setattr(estimate_module, "run_side_by_side", recording)
        answer = estimate(config_path, 2048, cache=FitCache(folder), workers=1, progress=False, **QUESTION)
    return folder, answer, ran


def test_a_cached_answer_is_the_cold_one_and_profiles_nothing(config_path, cold, fresh_process, monkeypatch):
    folder, answer, ran = cold
    assert sum(ran) >= 4 + 10  # both modes were profiled (memo: its fit, then its chosen policy's structure)
    assert len(list(folder.glob(f"*{fit_cache.SUFFIX}"))) == 4  # two modes' fits, the model states and the model
    _no_profiles(monkeypatch)
    warm = estimate(config_path, 2048, cache=FitCache(folder), workers=1, progress=False, **QUESTION)
    assert not fresh_process
    assert warm.to_dict() == answer.to_dict() and warm.table() == answer.table()
    assert warm.modes["memo"].policy == answer.modes["memo"].policy and answer.modes["memo"].longest_seq_len > 0


def test_a_changed_key_misses_and_budgets_are_not_in_it(tmp_path, config_path, fresh_process):
    cache = FitCache(tmp_path)
    question = dict(modes=["hf"], progress=False, workers=1, cache=cache)
    estimate(config_path, 4096, 24 * MiB, **question)
    assert fresh_process == [4]
    fit_cache.PROCESS_FITS.clear()
    estimate(config_path, 4096, 48 * MiB, host_memory=64 * MiB, **question)  # other budgets: the same fit
    assert fresh_process == [4]
    fit_cache.PROCESS_FITS.clear()
    estimate(config_path, 4096, 24 * MiB, batch_size=2, **question)  # another setup: fitted again
    assert fresh_process == [4, 4]
    fit_cache.PROCESS_FITS.clear()
    estimate(config_path, 4096, 24 * MiB, modes=["hf"], progress=False, workers=1, cache=False)
    assert fresh_process == [4, 4, 4]  # --no-cache reads nothing


def test_the_key_holds_the_code_and_disabled_caches_neither_read_nor_write(tmp_path, monkeypatch):
    cache = FitCache(tmp_path)
    key = cache.key(("fit", "config", 1))
    cache.store(key, {"bytes": 1})
    assert cache.load(key) == {"bytes": 1}
    assert cache.key(("fit", "config", 2)) != key and cache.load(cache.key(("fit", "config", 2))) is None
    monkeypatch.setattr(fit_cache, "code_fingerprint", lambda: "other code")  # an edit of hf_memo, a new torch
    assert cache.key(("fit", "config", 1)) != key
    off = FitCache(tmp_path, enabled=False)
    assert off.load(key) is None
    off.store(cache.key(("other",)), 1)
    assert len(list(tmp_path.iterdir())) == 1
    monkeypatch.setenv("HF_MEMO_CACHE_DIR", str(tmp_path / "here"))
    assert cache_dir() == tmp_path / "here" / "estimator" and FitCache().folder == cache_dir()


def test_the_fingerprint_covers_hf_memos_sources(tmp_path, monkeypatch):
    package = tmp_path / "hf_memo"
    package.mkdir()
    (package / "runtime.py").write_text("A = 1\n")
    monkeypatch.setattr(fit_cache, "_PACKAGE", package)
    fit_cache.fingerprint_parts.cache_clear()
    try:
        before = fit_cache.code_fingerprint()
        (package / "runtime.py").write_text("A = 2\n")
        fit_cache.fingerprint_parts.cache_clear()
        assert fit_cache.code_fingerprint() != before
    finally:
        fit_cache.fingerprint_parts.cache_clear()


def test_an_unreadable_entry_is_a_miss_and_is_written_again(tmp_path):
    cache = FitCache(tmp_path)
    key = cache.key(("fit",))
    cache.path(key).write_bytes(b"\x80\x05cut short")
    assert cache.load(key) is None
    cache.store(key, [1, 2])
    assert cache.load(key) == [1, 2]
    cache.path(key).write_bytes(b"")  # an empty file (a disk that filled up)
    assert cache.load(key) is None


WRITES = 4


def _entry(writer: int) -> np.ndarray:
    """Writer ``writer``'s value: 1 MiB that does not compress (256 pages a file), ``writer`` first."""
    value = np.random.default_rng(writer).integers(0, 2**62, 1 << 17)
    value[0] = writer
    return value


def _whole(value: np.ndarray) -> bool:
    return 1 <= value[0] <= 4 and np.array_equal(value, _entry(int(value[0])))


def _write(folder: str, key: str, writer: int) -> None:
    cache = FitCache(folder)
    for _ in range(WRITES):
        cache.store(key, _entry(writer))


def test_writers_at_once_leave_one_whole_entry_and_readers_never_see_half_of_one(tmp_path):
    cache = FitCache(tmp_path)
    key = cache.key(("fit", "shared"))
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write, args=(str(tmp_path), key, writer)) for writer in range(1, 5)]
    for process in writers:
        process.start()
    seen = False
    while any(process.is_alive() for process in writers):
        value = cache.load(key)
        if value is not None:
            assert _whole(value)
            seen = True
        else:  # absent before the first rename; whole ever after (a torn entry would read as a miss)
            assert not seen, "an entry read whole before was not readable: a write was not atomic"
    for process in writers:
        process.join()
        assert process.exitcode == 0
    final = cache.load(key)
    assert final is not None and _whole(final)
    assert [path.name for path in tmp_path.iterdir()] == [cache.path(key).name]  # no temporary file left behind
    assert os.stat(cache.path(key)).st_size > 0.9 * MiB


def test_a_cached_answer_reads_neither_pytorch_nor_transformers_nor_the_model_code(config_path, cold):
    """What makes a repeated question fast: the command answers from the cache having imported NumPy, not PyTorch
    (seconds to import), Transformers, PEFT, hf_memo's runtime or patches, or fake tensors' models, and answers as
    the cold run did."""
    folder, answer, _ = cold
    heavy = ("torch", "transformers", "peft", "hf_memo.patches", "hf_memo.runtime.memo", "hf_memo.profiler.fake_model")
    script = (
        "import sys; from hf_memo.integrations import cli; "
        f"code = cli.main(['estimate', '--model', {config_path!r}, *{FLAGS!r}]); "
        f"heavy = [m for m in {heavy!r} if m in sys.modules]; print('HEAVY', heavy, file=sys.stderr); sys.exit(code)"
    )
    env = {**os.environ, "HF_MEMO_CACHE_DIR": str(folder.parent)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "HEAVY []" in run.stderr
    assert json.loads(run.stdout)["modes"] == answer.to_dict()["modes"]


def test_shipped_fits_are_read_after_the_users_and_never_written(tmp_path, monkeypatch):
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    monkeypatch.setattr(fit_cache, "SHIPPED", shipped)
    maker = FitCache(shipped, read_shipped=False)
    key, other = maker.key(("fit", "shipped")), maker.key(("fit", "stale"))
    maker.store(key, "shipped fit")
    maker.path(other).write_bytes(maker.path(key).read_bytes())  # an entry under another name: not a hit
    cache = FitCache(user)
    assert cache.load(key) == "shipped fit" and cache.load(other) is None
    cache.store(key, "user's fit")  # a fit made here (memo's new block structures) goes to the user's folder
    assert cache.load(key) == "user's fit" and FitCache(shipped).load(key) == "shipped fit"
    assert sorted(path.name for path in shipped.iterdir()) == sorted([maker.path(key).name, maker.path(other).name])
    assert FitCache(tmp_path / "empty", read_shipped=False).load(key) is None
    assert FitCache(tmp_path / "empty", enabled=False).load(key) is None  # --no-cache reads no shipped fit either


def test_the_shipped_fits_are_whole_entries_of_the_current_sources():
    """The fits shipped for the documented questions were made by this code: an edit of hf_memo's sources without
    making them again (``python benchmarks/ship_estimator_fits.py``) fails here, not silently in users' waits."""
    manifest = fit_cache.shipped_manifest()
    assert manifest is not None, "no shipped fits: run python benchmarks/ship_estimator_fits.py"
    made, now = manifest["fingerprint"]["sources"], fit_cache.fingerprint_parts()["sources"]
    assert made == now, "hf_memo's sources changed since its fits were made: run benchmarks/ship_estimator_fits.py"
    entries = sorted(fit_cache.SHIPPED.glob(f"*{fit_cache.SUFFIX}"))
    assert len(entries) == manifest["entries"] > 0
    for entry in entries:
        assert fit_cache._read(entry, entry.name.removesuffix(fit_cache.SUFFIX)) is not None, entry.name


def test_the_documented_questions_answer_from_the_shipped_fits_without_pytorch(tmp_path):
    """Asked cold (an empty cache) where the libraries and Python are the shipped fits' own, each documented
    question in every mode is answered from them: nothing profiled (PyTorch never imported), nothing written."""
    manifest = fit_cache.shipped_manifest()
    here = fit_cache.fingerprint_parts()
    differ = {name: value for name, value in manifest["fingerprint"].items() if here[name] != value}
    if differ:
        pytest.skip(f"the shipped fits were made with {differ}, not this environment's versions")
    heavy = ("torch", "transformers", "hf_memo.runtime.memo", "hf_memo.profiler.fake_model")
    env = {**os.environ, "HF_MEMO_CACHE_DIR": str(tmp_path)}
    for name, flags in manifest["questions"].items():
        script = (
            "import sys; from hf_memo.integrations import cli; "
            f"code = cli.main(['estimate', *{flags.split()!r}, '--modes', {manifest['modes']!r}, '--json']); "
            f"heavy = [m for m in {heavy!r} if m in sys.modules]; print('HEAVY', heavy, file=sys.stderr); "
            "sys.exit(code)"
        )
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert run.returncode == 0, (name, run.stderr[-2000:])
        assert "HEAVY []" in run.stderr, name
        answer = json.loads(run.stdout)["modes"]
        assert set(answer) == set(manifest["modes"].split(",")), name
    assert not list(tmp_path.rglob(f"*{fit_cache.SUFFIX}"))
