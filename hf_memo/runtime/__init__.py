"""Run time: the layer executor's building blocks, and the arena that serves planned buffers."""

from hf_memo.runtime.arena import Arena, ArenaWarning

__all__ = ["Arena", "ArenaWarning"]
