"""``torch.utils.checkpoint`` (non-reentrant) whose forward may raise without leaving its saved-tensor hooks behind.

The non-reentrant checkpoint pushes saved-tensor hooks for the frame of its call inside a generator and pops them
when the generator resumes after the forward. In torch up to 2.11 an exception of the checkpointed function is not
thrown into that generator: while the exception is kept (hf_memo's self-check keeps the failure of its first
patched run to report it; a trainer that retries after an out-of-memory error may keep it), its traceback keeps the
generator suspended and the hooks stay pushed. Every tensor saved afterwards on that thread, in any graph, is then
packed by the dead frame, and the backward of that graph recomputes the failed call (with its arguments, e.g. an
attention mask of another run) instead of its own. torch 2.13 throws the exception into the generator (the hooks are
popped). :func:`checkpoint_call` does not depend on which: the forward's exception is caught inside the checkpointed
function, the checkpoint returns normally (popping its hooks), and the exception is raised after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def checkpoint_call(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``checkpoint(function, *args, use_reentrant=False, **kwargs)``; an exception of ``function`` in the forward
    is raised after the checkpoint has popped its saved-tensor hooks. A recomputation's exceptions pass unchanged;
    under ``torch.compile`` (which traces the checkpoint as one region and keeps no hooks) the call is plain."""
    if torch.compiler.is_compiling():
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    failed: list[BaseException] = []
    forward = True

    def guarded(*inner_args: Any, **inner_kwargs: Any) -> Any:
        if not forward:  # the recomputation in backward
            return function(*inner_args, **inner_kwargs)
        try:
            return function(*inner_args, **inner_kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised below, once the checkpoint has returned
            failed.append(error)
            return None

    out = checkpoint(guarded, *args, use_reentrant=False, **kwargs)
    forward = False
    if failed:
        error = failed.pop()  # not kept in this frame's list: no cycle through the traceback
        try:
            raise error
        finally:
            del error
    return out
