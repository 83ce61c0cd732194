"""Make the fits that ship with hf_memo: the documented ``hf-memo estimate`` questions, asked cold in every mode.

Each question of ``estimate_speed.py`` that names its host memory (the others depend on the machine that asks:
its RAM) is asked through the command line (its flags and defaults) with
``--modes`` every mode hf_memo estimates, into an empty cache folder and without reading the fits shipped now;
every entry the answers wrote (closed forms, memo's block structures, model states, the resolved model) then
replaces ``hf_memo/estimator/shipped_fits/``, with ``manifest.json``: the fingerprint's parts they were made with
(hf_memo's sources, library and Python versions), the questions and the modes. Any later edit of hf_memo's
sources makes them misses (their keys hold the sources); ``tests/test_estimator_fit_cache.py`` fails until this is
run again on the final sources, with the CI's library versions.

    python benchmarks/ship_estimator_fits.py        # 7-23 minutes on 2 cores, by the machine
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_memo.estimator import fit_cache

from common import ROOT
from estimate_speed import QUESTIONS

MODES = "hf,hf-checkpointing,none,full,selective,memo"
SHIPPED_QUESTIONS = {name: flags for name, flags in QUESTIONS.items() if "--host-memory" in flags}


def main() -> None:
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", "hf_memo"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    if any(line.endswith(".py") for line in changed.splitlines()):
        raise SystemExit(f"hf_memo has uncommitted source changes; commit them first:\n{changed}")
    from hf_memo.integrations import cli

    fit_cache.SHIPPED = Path(tempfile.mkdtemp(prefix="no_shipped_fits_"))  # nothing read from the shipped fits
    cache = Path(tempfile.mkdtemp(prefix="ship_fits_"))
    os.environ[fit_cache.CACHE_ENV] = str(cache)
    seconds = {}
    for name, flags in SHIPPED_QUESTIONS.items():
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["estimate", *flags.split(), "--modes", MODES, "--json"])
        if code:
            raise SystemExit(f"{name}: hf-memo estimate exited with {code}")
        seconds[name] = round(time.perf_counter() - started, 1)
        print(f"{name}: {seconds[name]} s", flush=True)
    shipped = ROOT / "hf_memo" / "estimator" / "shipped_fits"
    shutil.rmtree(shipped, ignore_errors=True)
    shipped.mkdir()
    entries = sorted((cache / "estimator").glob(f"*{fit_cache.SUFFIX}"))
    for entry in entries:
        shutil.copy(entry, shipped / entry.name)
    manifest = {
        "made": datetime.date.today().isoformat(),
        "fingerprint": fit_cache.fingerprint_parts(),
        "modes": MODES,
        "questions": SHIPPED_QUESTIONS,
        "seconds_in_order": seconds,
        "entries": len(entries),
    }
    (shipped / fit_cache.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"{len(entries)} entries, {sum(entry.stat().st_size for entry in entries):,} bytes -> {shipped}")


if __name__ == "__main__":
    sys.exit(main())
