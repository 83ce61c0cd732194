"""Run time: the memo layer executor and what it runs on (attention core, stash, host pool, copy streams,
offload LP), and the arena that serves planned buffers."""

from hf_memo.runtime.arena import Arena, ArenaWarning

__all__ = ["Arena", "ArenaWarning"]
