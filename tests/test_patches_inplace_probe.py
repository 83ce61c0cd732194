"""The probe for layers that write in place into outputs selective recompute keeps."""

import torch

from hf_memo.patches.forwards import MATMUL_OPS
from hf_memo.patches.inplace_probe import layers_writing_into_kept_outputs, writes_into_kept_outputs
from hf_memo.patches.structure import describe
from tests.conftest import build_model
from tests.model_catalog import build_catalog_model

W = torch.randn(3, 5, dtype=torch.float64)
X = torch.randn(2, 4, 3, dtype=torch.float64)


def test_a_clamp_into_a_projections_output_is_seen_through_its_view():
    assert writes_into_kept_outputs(lambda: torch.nn.functional.linear(X, W.T).clamp_(-0.1, 0.1), MATMUL_OPS)


def test_writes_elsewhere_and_out_of_place_ops_are_not():
    def layer():
        y = X @ W
        z = y.clamp(-0.1, 0.1)  # a new tensor
        z.add_(1.0)  # written into, but not a kept output
        return z

    assert not writes_into_kept_outputs(layer, MATMUL_OPS)
    assert not writes_into_kept_outputs(lambda: (X @ W).clamp_(-0.1, 0.1), set())  # nothing kept


def test_the_layers_are_probed_through_the_model_before_any_step():
    clamped = build_catalog_model("olmoe")  # clip_qkv: q/k/v clamped in place
    assert clamped.config.clip_qkv
    assert layers_writing_into_kept_outputs(clamped, describe(clamped).layers, MATMUL_OPS) == {0: True, 1: True}
    plain = build_model("llama")
    assert layers_writing_into_kept_outputs(plain, describe(plain).layers, MATMUL_OPS) == {0: False, 1: False}
    with torch.device("meta"):
        empty = build_model("llama", dtype=torch.float32)
    assert layers_writing_into_kept_outputs(empty, describe(empty).layers, MATMUL_OPS) is None
