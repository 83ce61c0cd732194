"""Class-level installers: patch every model of a family built from now on (e.g. by ``from_pretrained``).

The class's ``__init__`` is wrapped so each new instance is patched by the same instance-level
code as :func:`hf_memo.apply` — one code path, whether patched before or after loading.
"""

from __future__ import annotations

import functools
from typing import Any

from hf_memo.config import MemoConfig
from hf_memo.patches.family import Family
from hf_memo.patches.patching import patch_model, patch_state

_ORIGINAL_INIT = "_hf_memo_original_init"
_CLASS_CONFIG = "_hf_memo_class_config"


def install_on_class(family: Family, config: MemoConfig | None = None, **overrides: Any) -> None:
    """Make every ``family.causal_lm`` constructed from now on come out patched with ``config``.

    Calling it again changes the config for models built afterwards. Subclasses that define their
    own ``__init__`` are not patched automatically (call :func:`hf_memo.apply` on them).
    """
    cls = family.causal_lm
    setattr(cls, _CLASS_CONFIG, (config or MemoConfig()).replace(**overrides))
    if _ORIGINAL_INIT in cls.__dict__:
        return
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if type(self).__init__ is __init__ and patch_state(self) is None:
            patch_model(self, family, getattr(cls, _CLASS_CONFIG))

    setattr(cls, _ORIGINAL_INIT, original_init)
    cls.__init__ = __init__


def uninstall_from_class(family: Family) -> None:
    """Stop patching new ``family.causal_lm`` instances (models already built stay as they are)."""
    cls = family.causal_lm
    if _ORIGINAL_INIT in cls.__dict__:
        cls.__init__ = cls.__dict__[_ORIGINAL_INIT]
        delattr(cls, _ORIGINAL_INIT)
        delattr(cls, _CLASS_CONFIG)
