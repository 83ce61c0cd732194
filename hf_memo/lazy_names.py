"""A package's public names imported on first use (PEP 562), so importing the package loads none of its modules."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, public: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: a name of ``public`` (name -> the module it comes from) imported
    from its module on first use and kept in the package's namespace."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:  # noqa: N807 (the module hook's name)
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(public[name]), name)
        namespace[name] = value
        return value

    return __getattr__
