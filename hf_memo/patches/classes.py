"""Class-level installers: patch every model of a class built from now on (e.g. by ``from_pretrained``).

The class's ``__init__`` is wrapped so each new instance is patched by the same instance-level
code as :func:`hf_memo.apply` — one code path, whether patched before or after loading. The named
installers (``apply_hf_memo_to_llama``, ...) look their class up in transformers' modeling module when
called, so after ``importlib.reload`` of that module they patch the class it now defines.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel

from hf_memo.config import MemoConfig
from hf_memo.patches.patching import patch_model, patch_state

_ORIGINAL_INIT = "_hf_memo_original_init"
_CLASS_CONFIG = "_hf_memo_class_config"


def install_on_class(cls: type[PreTrainedModel], config: MemoConfig | None = None, **overrides: Any) -> None:
    """Make every ``cls`` (a ``*ForCausalLM`` class) constructed from now on come out patched with ``config``.

    Calling it again changes the config for models built afterwards. Subclasses that define their
    own ``__init__`` are not patched automatically (call :func:`hf_memo.apply` on them).

    Raises:
        TypeError: ``cls`` is not a transformers model class.
    """
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise TypeError(f"install_on_class takes a transformers model class, got {cls!r}")
    setattr(cls, _CLASS_CONFIG, (config or MemoConfig()).replace(**overrides))
    if _ORIGINAL_INIT in cls.__dict__:
        return
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if type(self).__init__ is __init__ and patch_state(self) is None:
            patch_model(self, getattr(cls, _CLASS_CONFIG))

    setattr(cls, _ORIGINAL_INIT, original_init)
    cls.__init__ = __init__


def uninstall_from_class(cls: type[PreTrainedModel]) -> None:
    """Stop patching new ``cls`` instances (models already built stay as they are)."""
    if _ORIGINAL_INIT in cls.__dict__:
        cls.__init__ = cls.__dict__[_ORIGINAL_INIT]
        delattr(cls, _ORIGINAL_INIT)
        delattr(cls, _CLASS_CONFIG)


def current_class(model_type: str, class_name: str) -> type[PreTrainedModel]:
    """``class_name`` as transformers' modeling module for ``model_type`` defines it now (after any reload)."""
    return getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), class_name)


def _named_installer(model_type: str, class_name: str) -> Callable[..., None]:
    def install(config: MemoConfig | None = None, **overrides: Any) -> None:
        install_on_class(current_class(model_type, class_name), config, **overrides)

    install.__name__ = install.__qualname__ = f"apply_hf_memo_to_{model_type}"
    install.__doc__ = f"Patch every ``{class_name}`` built from now on (call before ``from_pretrained``)."
    return install


apply_hf_memo_to_llama = _named_installer("llama", "LlamaForCausalLM")
apply_hf_memo_to_mistral = _named_installer("mistral", "MistralForCausalLM")
apply_hf_memo_to_qwen2 = _named_installer("qwen2", "Qwen2ForCausalLM")
apply_hf_memo_to_qwen3 = _named_installer("qwen3", "Qwen3ForCausalLM")
apply_hf_memo_to_gpt2 = _named_installer("gpt2", "GPT2LMHeadModel")
INSTALLERS = {
    "llama": apply_hf_memo_to_llama,
    "mistral": apply_hf_memo_to_mistral,
    "qwen2": apply_hf_memo_to_qwen2,
    "qwen3": apply_hf_memo_to_qwen3,
    "gpt2": apply_hf_memo_to_gpt2,
}
