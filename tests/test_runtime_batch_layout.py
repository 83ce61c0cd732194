"""The samples of a batch from its attention mask and positions, and the batches that are refused."""

import pytest
import torch

from hf_memo.runtime.batch_layout import BatchLayout, describe_batch, needs_masks_transformers_lacks


def test_a_batch_without_mask_or_positions_is_plain():
    layout = describe_batch(2, 7)
    assert layout.plain and layout.spans(2) == [(0, (0, 7)), (1, (0, 7))]
    assert layout.attended_pairs(2) == 2 * 28 and layout.longest() == layout.reach() == 7


def test_counting_positions_and_an_all_ones_mask_are_plain():
    layout = describe_batch(2, 5, torch.ones(2, 5), torch.arange(10, 15)[None])
    assert layout.plain


def test_restarting_or_jumping_positions_start_samples():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 7, 8, 9, 10]])
    layout = describe_batch(2, 8, position_ids=positions)
    assert layout.rows == (((0, 3), (3, 5), (5, 8)), ((0, 4), (4, 8)))
    assert layout.packed and layout.longest() == layout.reach() == 4 and layout.real_tokens(2) == 16
    assert layout.attended_pairs(2) == 6 + 3 + 6 + 10 + 10


def test_left_and_right_padding_leave_the_padding_out():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    layout = describe_batch(4, 5, mask)
    assert layout.rows == (((2, 5),), ((0, 3),), ((0, 5),), ())
    assert not layout.packed and layout.real_tokens(4) == 11


def test_a_right_padding_token_with_a_target_is_marked_a_left_padding_one_is_not():
    mask = torch.tensor([[0, 1, 1, 0]])
    left = describe_batch(1, 4, mask, shift_labels=torch.tensor([[5, 6, -100, -100]]))  # predicts a real token
    right = describe_batch(1, 4, mask, shift_labels=torch.tensor([[-100, 6, 7, 8]]))
    assert not left.padding_attends and right.padding_attends and right.rows == left.rows
    assert left.reach() == 2 and right.reach() == 3  # the last padding query attends back to the sample's start


def test_masked_tokens_between_real_ones_are_refused():
    with pytest.raises(ValueError, match="masked tokens between real ones"):
        describe_batch(1, 4, torch.tensor([[1, 0, 1, 1]]))


def test_packed_samples_then_padding_give_the_samples_and_leave_the_padding_out():
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2]])
    layout = describe_batch(2, 6, mask, positions)
    assert layout.rows == (((0, 2), (2, 5)), ((1, 3), (3, 6)))
    assert needs_masks_transformers_lacks(layout, 2)  # transformers skips packing detection when masked
    assert not needs_masks_transformers_lacks(describe_batch(2, 6, position_ids=positions), 2)


def test_positions_of_padding_may_jump():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 3], [1, 1, 0, 1]])  # generate-style left padding positions
    assert describe_batch(2, 4, mask, positions).rows == (((0, 4),), ((2, 4),))


def test_a_4d_mask_is_refused():
    with pytest.raises(ValueError, match=r"must be 2-D \(batch, seq_len\) padding, got shape \(1, 1, 4, 4\)"):
        describe_batch(1, 4, torch.ones(1, 1, 4, 4))


def test_padding_to_a_longer_row_keeps_the_samples():
    layout = BatchLayout(5, (((0, 2), (2, 5)),))
    assert layout.padded_to(8).rows == layout.rows and layout.padded_to(8).length == 8
    assert BatchLayout(5).padded_to(8).plain


def test_padding_with_targets_attends_to_its_rows_sample_as_a_non_causal_block():
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    targets = torch.tensor([[5, 6, 7, 8], [-100, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    layout = describe_batch(4, 4, mask, shift_labels=targets)
    assert layout.padding_attends
    spans = [(0, (0, 2), (0, 2), True), (1, (1, 3), (1, 3), True), (2, (0, 4), (0, 4), True)]
    assert layout.blocks(4) == [*spans, (0, (2, 4), (0, 2), False), (1, (3, 4), (1, 3), False)]
    assert layout.padded_to(6).blocks(4)[3:] == [
        (0, (2, 6), (0, 2), False),
        (1, (3, 6), (1, 3), False),
        (2, (4, 6), (0, 4), False),
    ]
    assert describe_batch(4, 4, mask).blocks(4) == spans  # padding without targets attends to nothing
