"""Run time: the memo layer executor and what it runs on (attention core, stash, host pool, copy streams,
offload LP), and the arena that serves planned buffers.

The public names are imported on first use (PEP 562): the estimator reads the length buckets
(:mod:`hf_memo.runtime.buckets`) without PyTorch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_memo.lazy_names import lazy_names

if TYPE_CHECKING:
    from hf_memo.runtime.arena import Arena, ArenaWarning

_PUBLIC = {"Arena": "hf_memo.runtime.arena", "ArenaWarning": "hf_memo.runtime.arena"}  # name -> its module

__all__ = ["Arena", "ArenaWarning"]

__getattr__ = lazy_names(__name__, _PUBLIC)
