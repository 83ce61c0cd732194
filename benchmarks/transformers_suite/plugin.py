"""A pytest plugin that applies hf_memo to every supported causal LM the tests under it build.

Load it with ``-p benchmarks.transformers_suite.plugin`` (repository root on ``PYTHONPATH``) and pick:

- ``--hf-memo-mode``: ``stock`` (nothing patched) or a ``MemoConfig.recompute`` mode
  (``none``, ``full``, ``selective``, ``memo``); default from ``HF_MEMO_MODE``, else ``stock``.
- ``--hf-memo-level``: ``instance`` (``hf_memo.apply(model, ...)`` on each new model) or ``class``
  (``hf_memo.patches.apply_hf_memo_to_<family>(...)`` before any model is built).
- ``--hf-memo-chunks``: ``mlp_chunks`` and ``lm_head_chunks``, so the tests' short sequences are
  really cut into mini-sequences (``"auto"`` keeps one chunk below ``min_chunk_tokens``).
- ``--hf-memo-offload-fraction``: ``offload_fraction`` of ``recompute="memo"``.

Only the ``*ForCausalLM`` classes hf_memo supports are patched; other heads (``*Model``,
``*ForSequenceClassification``, ...) run as in stock transformers.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
from transformers import PreTrainedModel

import hf_memo
from hf_memo.config import RECOMPUTE_MODES, MemoConfig
from hf_memo.patches import FAMILIES
from hf_memo.patches.classes import uninstall_from_class

MODES = ("stock", *RECOMPUTE_MODES)
LEVELS = ("instance", "class")
_ORIGINAL_POST_INIT = PreTrainedModel.post_init
_CAUSAL_LMS = tuple(family.causal_lm for family in FAMILIES.values())


class PatchCount:
    """Supported causal LMs built during the session, and how many of them came out patched.

    A model is checked at the end of the test that built it (the class-level installer patches it
    only after its ``__init__`` returns); until then it is held here.
    """

    def __init__(self) -> None:
        self.built = 0
        self.patched = 0
        self.pending: list[PreTrainedModel] = []

    def settle(self) -> None:
        self.built += len(self.pending)
        self.patched += sum(hf_memo.applied_config(model) is not None for model in self.pending)
        self.pending.clear()

    def line(self) -> str:
        return f"hf_memo patched {self.patched} of {self.built} supported causal LMs built"


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
    """Make every supported ``*ForCausalLM`` built from now on come out patched (nothing for ``stock``).

    Every such model built is also held in :data:`COUNT` until the end of its test.
    """
    config = None if mode == "stock" else memo_config(mode, chunks, offload_fraction)
    if config is not None and level == "class":
        for family in FAMILIES.values():
            installer = getattr(hf_memo.patches, f"apply_hf_memo_to_{family.model_type}")
            installer(config)

    @functools.wraps(_ORIGINAL_POST_INIT)
    def post_init(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        result = _ORIGINAL_POST_INIT(self, *args, **kwargs)
        if isinstance(self, _CAUSAL_LMS):
            COUNT.pending.append(self)
            if config is not None and level == "instance":
                hf_memo.apply(self, config)
        return result

    PreTrainedModel.post_init = post_init


def uninstall() -> None:
    """Undo :func:`install`: models built afterwards are stock again."""
    PreTrainedModel.post_init = _ORIGINAL_POST_INIT
    for family in FAMILIES.values():
        uninstall_from_class(family)


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
