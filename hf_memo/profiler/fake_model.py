"""Models whose tensors are fakes: full-size shapes and dtypes, no memory, for profiling on any machine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers.masking_utils as masking_utils
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


class FakeSession:
    """A ``FakeTensorMode`` that also keeps Transformers' mask decisions those of a real run.

    Without a KV cache, Transformers looks at the ``position_ids`` values to detect packed
    sequences; fake tensors have no values, so it would assume packing and build a full
    ``(S, S)`` mask that a real run never allocates. Inside the session, fake ``position_ids``
    count as one sequence per row, which is what profiling inputs (``arange`` positions) are.
    """

    def __init__(self) -> None:
        self.mode = FakeTensorMode()
        self._original = masking_utils.find_packed_sequence_indices

    def _find_packed(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if is_fake(position_ids) else self._original(position_ids)

    def __enter__(self) -> FakeSession:
        self.mode.__enter__()
        masking_utils.find_packed_sequence_indices = self._find_packed
        return self

    def __exit__(self, *exc: Any) -> None:
        masking_utils.find_packed_sequence_indices = self._original
        self.mode.__exit__(*exc)

    @contextmanager
    def converting_modules(self) -> Iterator[None]:
        """Let ``module.to(...)`` convert and ``copy.deepcopy`` copy fake modules (PEFT does both when it adds
        adapters and trainable copies of ``modules_to_save``).

        Fake parameters are converted by swapping tensors, which PyTorch refuses for a tensor that
        has a weak reference; the fake mode's memo of tensors it created holds such references.
        Inside this block the memo holds plain references instead, then the weak memo comes back.
        A deep copy of a fake tensor copies its attributes, the fake mode among them: inside this
        block the mode copies as itself, so copies stay in this session.
        """
        converter = self.mode.fake_tensor_converter.meta_converter
        weak_memo = converter.tensor_memo
        converter.tensor_memo = {}
        self.mode.__deepcopy__ = lambda memo: self.mode
        try:
            yield
        finally:
            del self.mode.__deepcopy__
            converter.tensor_memo = weak_memo


def fake_causal_lm(
    config: PretrainedConfig, dtype: torch.dtype = torch.bfloat16
) -> tuple[PreTrainedModel, FakeSession]:
    """A ``*ForCausalLM`` built from ``config`` with fake parameters, in train mode, and its session.

    Construction runs inside the returned :class:`FakeSession`, so an 8B-parameter model costs no
    memory and builds in well under a second; run the step inside the same session.
    """
    session = FakeSession()
    with session:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train(), session
