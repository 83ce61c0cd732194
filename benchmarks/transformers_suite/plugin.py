"""A pytest plugin that applies hf_memo to every causal LM the tests under it build that hf_memo accepts.

Load it with ``-p benchmarks.transformers_suite.plugin`` (repository root on ``PYTHONPATH``) and pick:

- ``--hf-memo-mode``: ``stock`` (nothing patched) or a ``MemoConfig.recompute`` mode
  (``none``, ``full``, ``selective``, ``memo``); default from ``HF_MEMO_MODE``, else ``stock``.
- ``--hf-memo-level``: ``instance`` (``hf_memo.apply(model, ...)`` on each new causal LM) or ``class``
  (``hf_memo.patches.install_on_class`` on the causal-LM class of every model type hf_memo's tests prove
  exact, ``hf_memo.patches.supported_model_types()``, before any model is built).
- ``--hf-memo-chunks``: ``mlp_chunks`` and ``lm_head_chunks``, so the tests' short sequences are
  really cut into mini-sequences (``"auto"`` keeps one chunk below ``min_chunk_tokens``).
- ``--hf-memo-offload-fraction``: ``offload_fraction`` of ``recompute="memo"``.

A causal LM is a model of a class transformers maps as one (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: the
``*ForCausalLM`` classes, GPT-2's ``GPT2LMHeadModel``, Gemma 3's ``Gemma3ForConditionalGeneration``, ...).
Instance level patches every one: a refusal (``hf_memo.apply`` raises ``ValueError`` naming what blocks it)
of a model type outside ``supported_model_types()`` leaves that model stock and is counted, one of a proven
model type fails the test as before. Other heads (``*Model``, ``*ForSequenceClassification``, ...) are left
alone.
"""

from __future__ import annotations

import collections
import functools
import os
from typing import Any

import pytest
import transformers
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_memo
from hf_memo.config import RECOMPUTE_MODES, MemoConfig
from hf_memo.patches import install_on_class, supported_model_types, uninstall_from_class

MODES = ("stock", *RECOMPUTE_MODES)
LEVELS = ("instance", "class")
_ORIGINAL_POST_INIT = PreTrainedModel.post_init
_CAUSAL_LM_NAMES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def is_causal_lm(model: PreTrainedModel) -> bool:
    """Whether ``model`` is (a subclass of) a class transformers maps as a causal LM."""
    return any(
        cls.__name__ in _CAUSAL_LM_NAMES and cls.__module__.startswith("transformers.") for cls in type(model).__mro__
    )


def class_level_classes() -> list[type[PreTrainedModel]]:
    """The causal-LM class of every model type hf_memo's tests prove exact (as transformers defines it now)."""
    return [getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t]) for t in supported_model_types()]


class PatchCount:
    """Causal LMs built during the session that hf_memo did not refuse, how many of them came out patched, and
    why hf_memo refused the others.

    A model is checked at the end of the test that built it (the class-level installer patches it
    only after its ``__init__`` returns); until then it is held here.
    """

    def __init__(self) -> None:
        self.built = 0
        self.patched = 0
        self.pending: list[PreTrainedModel] = []
        self.refusals: collections.Counter[str] = collections.Counter()

    def settle(self) -> None:
        self.built += len(self.pending)
        self.patched += sum(hf_memo.applied_config(model) is not None for model in self.pending)
        self.pending.clear()

    def line(self) -> str:
        refused = "".join(f"; refused {n}x: {reason}" for reason, n in self.refusals.most_common())
        return f"hf_memo patched {self.patched} of {self.built} supported causal LMs built{refused}"


COUNT = PatchCount()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hf_memo", "hf_memo applied to the models the tests build")
    group.addoption("--hf-memo-mode", default=os.environ.get("HF_MEMO_MODE", "stock"), choices=MODES)
    group.addoption("--hf-memo-level", default=os.environ.get("HF_MEMO_LEVEL", "instance"), choices=LEVELS)
    group.addoption("--hf-memo-chunks", type=int, default=int(os.environ.get("HF_MEMO_CHUNKS", "3")))
    group.addoption(
        "--hf-memo-offload-fraction", type=float, default=float(os.environ.get("HF_MEMO_OFFLOAD_FRACTION", "0.5"))
    )


def memo_config(mode: str, chunks: int, offload_fraction: float) -> MemoConfig:
    """The config the tests' models are patched with for ``mode`` (one of the recompute modes)."""
    memo_only = {"offload_fraction": offload_fraction} if mode == "memo" else {}  # an error in any other mode
    return MemoConfig(recompute=mode, mlp_chunks=chunks, lm_head_chunks=chunks, **memo_only)


def install(mode: str, level: str, chunks: int, offload_fraction: float) -> None:
    """Make every causal LM built from now on that hf_memo accepts come out patched (nothing for ``stock``).

    Every causal LM built that hf_memo does not refuse is also held in :data:`COUNT` until the end of its test.
    """
    config = None if mode == "stock" else memo_config(mode, chunks, offload_fraction)
    if config is not None and level == "class":
        for cls in class_level_classes():
            install_on_class(cls, config)

    @functools.wraps(_ORIGINAL_POST_INIT)
    def post_init(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        result = _ORIGINAL_POST_INIT(self, *args, **kwargs)
        if not is_causal_lm(self):
            return result
        if config is not None and level == "instance":
            try:
                hf_memo.apply(self, config)
            except ValueError as refusal:
                if self.config.model_type in supported_model_types():
                    raise
                COUNT.refusals[str(refusal).splitlines()[0]] += 1  # not patched exactly: the test runs it stock
                return result
        COUNT.pending.append(self)
        return result

    PreTrainedModel.post_init = post_init


def uninstall() -> None:
    """Undo :func:`install`: models built afterwards are stock again."""
    PreTrainedModel.post_init = _ORIGINAL_POST_INIT
    for cls in class_level_classes():
        uninstall_from_class(cls)


def pytest_configure(config: pytest.Config) -> None:
    install(
        config.getoption("--hf-memo-mode"),
        config.getoption("--hf-memo-level"),
        config.getoption("--hf-memo-chunks"),
        config.getoption("--hf-memo-offload-fraction"),
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    uninstall()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    COUNT.settle()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    COUNT.settle()
    terminalreporter.write_line(COUNT.line())


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"hf_memo: mode={config.getoption('--hf-memo-mode')} level={config.getoption('--hf-memo-level')} "
        f"chunks={config.getoption('--hf-memo-chunks')} "
        f"offload_fraction={config.getoption('--hf-memo-offload-fraction')}"
    )
