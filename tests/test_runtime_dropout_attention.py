"""The explicit kernel's dropout mask: its keep rate, independence, slices and seeds (the kernel itself is tested
against autograd with this mask in test_runtime_explicit_attention.py)."""

import torch

from hf_memo.runtime.dropout_attention import draw_seed, keep_mask

CPU = torch.device("cpu")


def test_mask_keeps_the_expected_fraction_and_any_block_is_a_slice_of_the_whole():
    whole = keep_mask(11, 0.2, 2, 3, 64, (0, 64), 64, CPU)
    assert whole.shape == (2, 3, 64, 64) and whole.dtype == torch.bool
    assert abs(whole.float().mean().item() - 0.8) < 0.01
    assert torch.equal(keep_mask(11, 0.2, 2, 3, 64, (17, 40), 40, CPU), whole[:, :, 17:40, :40])
    assert torch.equal(keep_mask(11, 0.2, 2, 3, 64, (17, 40), 40, CPU, first_key=12), whole[:, :, 17:40, 12:40])
    assert not torch.equal(keep_mask(12, 0.2, 2, 3, 64, (0, 64), 64, CPU), whole)
    # no correlation between neighbouring keys, heads or sequences
    flat = whole.float() - 0.8
    for a, b in ((flat[..., 1:], flat[..., :-1]), (flat[:, 1:], flat[:, :-1]), (flat[1:], flat[:-1])):
        assert abs((a * b).mean().item()) < 0.01


def test_seeds_come_from_the_default_generator():
    torch.manual_seed(3)
    first = draw_seed()
    assert draw_seed() != first
    torch.manual_seed(3)
    assert draw_seed() == first
