"""Packed batches refused for a model whose masks ignore the packing (gpt_oss), in every mode; accepted elsewhere."""

import copy

import pytest
import torch
from transformers import masking_utils

import hf_memo
from tests.conftest import build_model
from tests.model_catalog import build_catalog_model

MODES = [{"recompute": "none"}, {"recompute": "full"}, {"recompute": "selective"}, {"recompute": "memo"}]
MODES += [{"recompute": "memo", "offload_fraction": 1.0}]


def _packed(length=12, cut=5):
    ids = torch.randint(3, 100, (1, length), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(cut), torch.arange(length - cut)])[None]
    labels = ids.clone()
    labels[0, [0, cut]] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def test_unpatched_gpt_oss_attends_across_packed_samples():
    """What the refusal rests on: the second sample's logits in the packed row differ from the sample alone."""
    model = build_catalog_model("gpt_oss").eval()
    batch, cut = _packed(), 5
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0, cut:]
        alone = model(input_ids=batch["input_ids"][:, cut:]).logits[0]
    assert (packed - alone).abs().max() > 1e-2 * alone.abs().max()  # not rounding: other tokens seen


@pytest.mark.parametrize("kwargs", MODES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_gpt_oss_packed_batch_is_refused_in_every_mode_and_the_mask_builders_are_restored(kwargs):
    model = build_catalog_model("gpt_oss")
    hf_memo.apply(model, **kwargs)
    original = masking_utils._preprocess_mask_arguments
    with pytest.raises(ValueError, match="gpt_oss's forward builds its attention masks without the position_ids"):
        model(**_packed())
    assert masking_utils._preprocess_mask_arguments is original
    batch = _packed()  # one sample per row: trains
    del batch["position_ids"]
    model(**batch).loss.backward()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_batches_of_models_whose_masks_see_the_packing_train_like_the_unpatched_model(family):
    reference = build_model(family, seed=0)
    model = copy.deepcopy(reference)
    hf_memo.apply(model, recompute="memo", mlp_chunks=3)
    original = masking_utils._preprocess_mask_arguments
    out = model(**_packed())
    assert masking_utils._preprocess_mask_arguments is original
    want = reference(**_packed(), use_cache=False).loss
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=1e-9)
