"""Packed training steps refused for a model whose forward hides the packing from transformers' mask builders.

transformers sees packed samples (``position_ids`` restarting inside a row, no ``attention_mask``) only through
the ``position_ids`` its mask builders receive (``masking_utils``: ``create_causal_mask`` and its siblings find the
samples' borders there). A model whose forward builds its masks without them (``gpt_oss`` in transformers 5.x)
lets the packed samples attend to each other, unpatched. hf_memo attends per sample wherever it computes attention
itself (the memo executor, wrapped implementations, sequence parallelism) and with transformers' masks elsewhere,
so such a batch would train across samples in some modes and per sample in others, unlike the unpatched model
in either case. It is refused in every mode instead, the first time a mask is built for it.

Checked by behaviour, not by reading the model's source: for the duration of a packed step's backbone forward,
the mask builders' common argument check raises if it is called without ``position_ids`` (and without a cache,
which a training step never has).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from transformers import masking_utils

from hf_memo.runtime.batch_layout import LAYOUT_KEYWORD

_CHECKED = "_preprocess_mask_arguments"  # every mask builder of masking_utils calls it with its arguments


@contextlib.contextmanager
def masks_see_packing(model_type: str, arguments: dict[str, Any]) -> Iterator[None]:
    """Run the backbone's forward on ``arguments`` (described by
    :func:`~hf_memo.patches.packing.describe_training_batch`) inside this; a step without packed samples is not
    watched.

    Raises:
        ValueError: the batch packs samples and a mask of ``model_type`` was built without ``position_ids``.
    """
    layout = arguments.get(LAYOUT_KEYWORD)
    original = getattr(masking_utils, _CHECKED, None)
    if layout is None or not layout.packed or original is None:
        yield
        return
    signature = inspect.signature(original)

    def checked(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind(*args, **kwargs).arguments
        if given.get("position_ids") is None and given.get("cache", given.get("past_key_values")) is None:
            raise ValueError(
                f"this batch packs several samples per row (position_ids restart), and {model_type}'s forward "
                "builds its attention masks without the position_ids, so in transformers the packed samples "
                "attend to each other; put one sample per row (padding marked by an attention_mask)"
            )
        return original(*args, **kwargs)

    setattr(masking_utils, _CHECKED, checked)
    try:
        yield
    finally:
        setattr(masking_utils, _CHECKED, original)
