"""The estimator's on-disk cache of fitted closed forms: a question asked before profiles nothing.

A closed form (:class:`~hf_memo.estimator.fitted.FittedFootprint`, memo's
:class:`~hf_memo.estimator.memo_policy.MemoModel` with every block structure profiled so far) and the model
states' counts depend on the model's config, the setup (mode, trainable, LoRA, optimizer, dtype, batch size,
sequence parallelism, the positions the model allows) and the code that ran the profiles: hf_memo's, PyTorch's,
Transformers' and PEFT's. An entry's key is a SHA-256 of all of them, hf_memo's sources included (its version
string does not change with every edit), so an entry is never read by other code than wrote it. Budgets (GPU,
host and pinned memory, reserves), the GPU model and the ZeRO settings are applied after the fit and are not in
the key: one fit answers them all.

Entries are pickles, compressed (LZMA: a memo fit's closed forms shrink about 50x, read back in tens of
milliseconds), in the user's cache directory (``$HF_MEMO_CACHE_DIR``, else ``$XDG_CACHE_HOME/hf_memo`` or
``~/.cache/hf_memo``; ``%LOCALAPPDATA%\\hf_memo`` on Windows, ``~/Library/Caches/hf_memo`` on macOS), under
``estimator/``. A writer writes a temporary file beside the entry and renames it over the entry
(``os.replace``, atomic on one file system), so two runs writing at once leave one whole entry, never a mix, and
a reader sees an old whole entry or a new one. An entry that cannot be read (cut short, written by another
Python) is a miss and is written again.

Fits made for the documented questions ship with hf_memo (``shipped_fits/``, made by
``benchmarks/ship_estimator_fits.py`` with the code of the release): they are read after the user's cache, never
written, and are keyed like any entry, so they answer only where the code, the libraries and Python are the ones
that made them (``manifest.json`` names them); anywhere else they are misses and the question is profiled.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import pickle
import platform
import sys
import tempfile
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

CACHE_ENV = "HF_MEMO_CACHE_DIR"  # the folder the cache lives in (its estimator/ subfolder holds the entries)
FORMAT = 2  # of an entry's contents; a change makes every older entry a miss
_PACKAGE = Path(__file__).resolve().parents[1]  # hf_memo/
_LIBRARIES = ("hf-memo", "torch", "transformers", "peft", "numpy")
SHIPPED = Path(__file__).resolve().parent / "shipped_fits"  # the documented questions' fits, read-only
SUFFIX = ".pkl.xz"  # an entry's file: its key, then this
MANIFEST = "manifest.json"  # in SHIPPED: the fingerprint's parts the shipped fits were made with


def cache_dir() -> Path:
    """The folder of the estimator's entries: ``$HF_MEMO_CACHE_DIR/estimator``, else the user's cache directory's
    ``hf_memo/estimator``."""
    if os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV])
    elif sys.platform == "win32":
        root = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local")) / "hf_memo"
    elif sys.platform == "darwin":
        root = Path.home() / "Library" / "Caches" / "hf_memo"
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_memo"
    return root / "estimator"


def _installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


@lru_cache(maxsize=1)
def fingerprint_parts() -> dict[str, str]:
    """What a fit depends on besides the question: the entry format, Python's version (pickles), the versions of
    hf_memo, PyTorch, Transformers, PEFT and NumPy, and ``sources``, a SHA-256 of hf_memo's sources (every ``.py``
    file of the package, by path and contents)."""
    sources = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        sources.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    libraries = {name: _installed(name) for name in _LIBRARIES}
    return {"format": str(FORMAT), "python": platform.python_version(), **libraries, "sources": sources.hexdigest()}


def code_fingerprint() -> str:
    """A SHA-256 of :func:`fingerprint_parts`: the code a fit depends on."""
    return hashlib.sha256(json.dumps(fingerprint_parts(), sort_keys=True).encode()).hexdigest()


def shipped_manifest() -> dict | None:
    """The shipped fits' manifest (the fingerprint's parts they were made with, the questions and modes asked),
    or ``None`` where none shipped."""
    try:
        return json.loads((SHIPPED / MANIFEST).read_text())
    except FileNotFoundError:
        return None


def _read(path: Path, key: str) -> Any | None:
    """The value of the entry at ``path`` if it is a whole entry stored under ``key``, else ``None``."""
    try:
        stored_key, value = pickle.loads(lzma.decompress(path.read_bytes()))
    except Exception:  # absent, cut short, or written by other code: a miss (written again after the fit)
        return None
    return value if stored_key == key else None


class FitCache:
    """Fits on disk under ``folder`` (default :func:`cache_dir`), by key, and then the shipped fits
    (:data:`SHIPPED`, read-only); ``enabled=False`` reads and writes nothing (``--no-cache``).

    Args:
        folder: where the entries are (created on the first write).
        enabled: whether to read and write at all.
        read_shipped: whether to read the fits shipped with hf_memo after ``folder``'s.
    """

    def __init__(self, folder: str | Path | None = None, enabled: bool = True, read_shipped: bool = True) -> None:
        self.folder = Path(folder) if folder is not None else cache_dir()
        self.enabled = enabled
        self.shipped = SHIPPED if read_shipped else None

    @staticmethod
    def key(parts: tuple) -> str:
        """The entry name of what ``parts`` (a tuple with a deterministic ``repr``: strings, numbers, frozen
        dataclasses) describes, with the code it was fitted by (:func:`code_fingerprint`)."""
        return hashlib.sha256(f"{code_fingerprint()}\n{parts!r}".encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def load(self, key: str) -> Any | None:
        """The value stored under ``key`` in ``folder``, else in the shipped fits, or ``None`` (disabled, absent,
        or not readable as a whole entry)."""
        if not self.enabled:
            return None
        value = _read(self.path(key), key)
        if value is None and self.shipped is not None:
            value = _read(self.shipped / f"{key}{SUFFIX}", key)
        return value

    def store(self, key: str, value: Any) -> None:
        """Write ``value`` under ``key``: to a temporary file in the same folder, then renamed over the entry, so
        that a reader never sees half an entry and concurrent writers leave one whole entry. A folder that cannot
        be written (read-only, full disk) leaves the estimate uncached, not failed."""
        if not self.enabled:
            return
        temporary = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.folder, prefix=f".{key[:16]}.", suffix=".tmp")
            with os.fdopen(handle, "wb") as file:
                file.write(lzma.compress(pickle.dumps((key, value), protocol=pickle.HIGHEST_PROTOCOL), preset=1))
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path(key))
            temporary = None
        except OSError:
            pass
        finally:
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)


# This process's closed forms and model states, by what they depend on: a repeated question profiles nothing.
# Profiles are deterministic and each starts from a fresh model, so reusing a closed form changes no answer.
PROCESS_FITS: dict[tuple, Any] = {}
