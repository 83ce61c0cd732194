"""hf_memo: long-context training for Hugging Face Transformers in one line, ``hf_memo.apply(model)``.

The public names below are imported on first use (PEP 562), so ``import hf_memo`` — and with it ``hf-memo --help``,
``hf-memo --version`` and :mod:`hf_memo.data` — does not import PyTorch and Transformers. The memo runtime's
planner and policy sizer, which the integrations register, are imported on the runtime's first call to them
(:class:`_RegisterIntegrations`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hf_memo.lazy_names import lazy_names

if TYPE_CHECKING:
    from hf_memo.config import MemoConfig
    from hf_memo.estimator.estimate import estimate
    from hf_memo.integrations.planning import plan_training_step
    from hf_memo.integrations.trainer import MemoCallback
    from hf_memo.patches import applied_config, apply, check, memo_runtime, revert, supported_model_types

__version__ = "0.1.0"

_PUBLIC = {  # name -> the module it comes from
    "MemoCallback": "hf_memo.integrations.trainer",
    "MemoConfig": "hf_memo.config",
    "applied_config": "hf_memo.patches",
    "apply": "hf_memo.patches",
    "check": "hf_memo.patches",
    "estimate": "hf_memo.estimator.estimate",
    "memo_runtime": "hf_memo.patches",
    "plan_training_step": "hf_memo.integrations.planning",
    "revert": "hf_memo.patches",
    "supported_model_types": "hf_memo.patches",
}

__all__ = [
    "MemoCallback",
    "MemoConfig",
    "applied_config",
    "apply",
    "check",
    "estimate",
    "memo_runtime",
    "plan_training_step",
    "revert",
    "supported_model_types",
]


__getattr__ = lazy_names(__name__, _PUBLIC)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


class _Deferred:
    """Stands in a runtime registry for ``module.function`` until that module is imported, then calls it.

    Importing ``module`` registers its real function in the registry, replacing this stand-in.
    """

    def __init__(self, module: str, function: str) -> None:
        self.module, self.function = module, function

    def resolve(self) -> Any:
        """The function this stands for (its module imported)."""
        return getattr(importlib.import_module(self.module), self.function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


_REGISTRIES = {  # runtime registry module -> (its register function, the integration module and function it calls)
    "hf_memo.runtime.model_planner": ("register_model_planner", "hf_memo.integrations.planning", "plan_training_step"),
    "hf_memo.runtime.policy_sizer": (
        "register_policy_sizer",
        "hf_memo.integrations.policy_sizing",
        "policy_working_bytes",
    ),
}


class _RegisterIntegrations(importlib.abc.MetaPathFinder):
    """Fills the memo runtime's registries with :class:`_Deferred` stand-ins as they are imported.

    The runtime plans and sizes through integrations it must not import (``hf_memo.runtime.model_planner``,
    ``hf_memo.runtime.policy_sizer``); the integrations register themselves when imported. Before the package's
    names were lazy, ``import hf_memo`` imported them; now a registry gets a stand-in that imports its integration on
    first call, however the registry was reached (``from hf_memo.patches import apply`` included), unless the
    integration is already being imported (it then registers itself). The finder finds nothing itself: it wraps the
    normal loader of each registry module once, then leaves.
    """

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in _REGISTRIES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute, (register, module, function) = spec.loader.exec_module, _REGISTRIES[fullname]

        def exec_module(registry: ModuleType) -> None:
            execute(registry)
            if module not in sys.modules:
                getattr(registry, register)(_Deferred(module, function))
            if all(name in sys.modules for name in _REGISTRIES) and self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module
        return spec


if not all(name in sys.modules for name in _REGISTRIES):
    sys.meta_path.insert(0, _RegisterIntegrations())
