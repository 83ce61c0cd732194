"""Reversible changes to live modules: replacement forwards and the record that undoes them."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any


class _Missing:
    """Marks an attribute that was absent before patching (a class, so ``copy.deepcopy`` keeps its identity)."""


class InstalledForward:
    """A replacement ``forward`` on one module instance: calls ``impl(module, inner, *args, **kwargs)``.

    ``inner`` is the forward it replaced. ``inspect.signature`` sees ``inner``'s signature (the
    Trainer reads it to find loss kwargs and dataset columns), and ``copy.deepcopy`` of the model
    rebinds the copy to the copied module and to copies of what ``impl`` is bound to (the model, its
    memo runtime, the final-norm flag), shared within the copy as they are within the original. Once
    ``active`` is false (reverted while another library's forward wraps it) it calls ``inner`` unchanged.
    """

    def __init__(self, module: Any, inner: Callable, impl: Callable) -> None:
        self.module = module
        self.inner = inner
        self.impl = impl
        self.active = True
        self.__wrapped__ = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.inner(*args, **kwargs)
        return self.impl(self.module, self.inner, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> InstalledForward:
        copied = InstalledForward(
            copy.deepcopy(self.module, memo), copy.deepcopy(self.inner, memo), copy.deepcopy(self.impl, memo)
        )
        copied.active = self.active
        return copied


class PatchRecord:
    """Instance attributes hf_memo set, with what was there before, so ``undo`` restores it exactly.

    An installed forward that something else replaced after hf_memo (e.g. TRL wrapping ``model.forward``)
    is left in its place on ``undo``, switched off: the wrapper keeps working and calls the original.
    """

    def __init__(self) -> None:
        self._changes: list[tuple[Any, str, Any, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._changes.append((obj, name, obj.__dict__.get(name, _Missing), value))
        setattr(obj, name, value)

    def install_forward(self, module: Any, impl: Callable) -> None:
        """Replace ``module.forward`` (whatever it currently is) by ``impl`` wrapped around it."""
        self.set(module, "forward", InstalledForward(module, module.forward, impl))

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Inside, the module behaves as unpatched: every installed forward calls what it replaced, every other
        attribute set is what it was before. Afterwards everything is as it was inside :meth:`set`."""
        switched = []
        for obj, name, previous, value in reversed(self._changes):
            if isinstance(value, InstalledForward):
                switched.append((value, value.active))
                value.active = False
            elif previous is _Missing:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = previous
        try:
            yield
        finally:
            for forward, active in switched:
                forward.active = active
            for obj, name, _previous, value in self._changes:
                if not isinstance(value, InstalledForward):
                    obj.__dict__[name] = value

    def undo_attribute(self, name: str) -> None:
        """Undo every change of an attribute called ``name`` (not installed forwards), keeping the others."""
        kept = []
        for change in self._changes:
            obj, changed, previous, value = change
            if changed != name or isinstance(value, InstalledForward):
                kept.append(change)
            elif previous is _Missing:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = previous
        self._changes = kept

    def undo(self) -> None:
        for obj, name, previous, value in reversed(self._changes):
            if isinstance(value, InstalledForward):
                value.active = False
                if obj.__dict__.get(name, _Missing) is not value:
                    continue  # replaced since by a wrapper of someone else's, which now reaches the original
            if previous is _Missing:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)
        self._changes.clear()
