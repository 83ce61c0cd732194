"""Cutting a batch into sequence shards: shift before cutting, positions kept, padding, no host reads."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_memo.minseq.lm_head import shifted_targets
from hf_memo.parallel.sharding import batch_fingerprint, shard_batch


def _batch(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 50, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[torch.rand(batch, seq, generator=gen) < 0.3] = -100
    return ids, labels


def _shards(arguments, labels, size, **kwargs):
    return [shard_batch(arguments, labels, None, rank, size, **kwargs) for rank in range(size)]


@pytest.mark.parametrize("seq,size", [(16, 2), (13, 2), (18, 4), (3, 4), (1, 2), (9, 8)])
def test_shards_cover_the_shifted_labels_and_pad_with_ignored_targets(seq, size):
    ids, labels = _batch(2, seq)
    shards = _shards({"input_ids": ids}, labels, size)
    padded = -(-seq // size) * size
    assert all(s.padded_length == padded for s in shards)
    assert all(s.shift_labels.shape == (2, padded // size) for s in shards)
    joined_targets = torch.cat([s.shift_labels for s in shards], dim=1)
    joined_ids = torch.cat([s.arguments["input_ids"] for s in shards], dim=1)
    torch.testing.assert_close(joined_targets[:, :seq], shifted_targets(labels))
    torch.testing.assert_close(joined_ids[:, :seq], ids)
    assert (joined_targets[:, seq:] == -100).all()
    total = (shifted_targets(labels) != -100).sum()
    assert all(int(s.target_tokens) == int(total) for s in shards)


def test_the_token_at_a_shard_border_predicts_the_first_token_of_the_next_shard():
    ids = torch.arange(10, 26).unsqueeze(0)
    first, second = _shards({"input_ids": ids}, ids, 2)
    assert int(first.shift_labels[0, -1]) == int(second.arguments["input_ids"][0, 0]) == 18
    assert int(second.shift_labels[0, -1]) == -100  # the last token has no next token


def test_position_ids_are_global_and_padding_continues_them():
    ids, labels = _batch(2, 7)
    shards = _shards({"input_ids": ids}, labels, 4)
    positions = torch.cat([s.arguments["position_ids"] for s in shards], dim=1)
    assert positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]] * 2
    given = torch.arange(100, 107).unsqueeze(0)
    shards = _shards({"input_ids": ids, "position_ids": given}, labels, 2)
    assert shards[1].arguments["position_ids"].tolist() == [[104, 105, 106, 107]] * 2


def test_padded_positions_stay_in_a_learned_position_table():
    ids, labels = _batch(1, 7)
    shards = _shards({"input_ids": ids}, labels, 4, max_positions=8)
    assert shards[3].arguments["position_ids"].tolist() == [[6, 7]]
    shards = _shards({"input_ids": ids}, labels, 3, max_positions=8)
    assert shards[2].arguments["position_ids"].tolist() == [[6, 7, 7]]
    # positions already past the table (RoPE models run beyond it) are continued, not capped
    shards = _shards({"input_ids": ids, "position_ids": torch.arange(10, 17).unsqueeze(0)}, labels, 4, max_positions=8)
    assert shards[3].arguments["position_ids"].tolist() == [[16, 17]]


def test_packed_rows_keep_every_token_s_position_in_its_sample():
    ids, labels = _batch(2, 7)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 0, 1]])
    shards = _shards({"input_ids": ids, "position_ids": positions}, labels, 2, max_positions=64)
    joined = torch.cat([s.arguments["position_ids"] for s in shards], dim=1)
    assert joined.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2]]


class _ScalarReads(TorchDispatchMode):
    """Counts reads of tensor values on the host (``.item()``, ``bool(t)``: a device sync on an accelerator)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_sharding_reads_no_value_on_the_host():
    ids, labels = _batch(2, 13)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5]] * 2)
    with _ScalarReads() as reads:
        _shards({"input_ids": ids, "position_ids": positions}, labels, 4, max_positions=8)
    assert reads.count == 0


def test_shift_labels_given_are_used_instead_of_labels():
    ids, labels = _batch(1, 8)
    shift = shifted_targets(labels)
    shift[0, 2] = 7
    shard = shard_batch({"input_ids": ids}, None, shift, 0, 2)
    assert int(shard.shift_labels[0, 2]) == 7


def test_inputs_embeds_and_token_type_ids_are_cut_too():
    embeds = torch.randn(2, 5, 3)
    types = torch.ones(2, 5, dtype=torch.long)
    labels = torch.zeros(2, 5, dtype=torch.long)
    last = shard_batch({"inputs_embeds": embeds, "token_type_ids": types}, labels, None, 1, 2)
    assert last.arguments["inputs_embeds"].shape == (2, 3, 3)
    torch.testing.assert_close(last.arguments["inputs_embeds"][:, :2], embeds[:, 3:])
    assert (last.arguments["inputs_embeds"][:, 2] == 0).all()
    assert last.arguments["token_type_ids"].tolist() == [[1, 1, 0]] * 2


def test_fingerprints_tell_batches_apart():
    ids, labels = _batch(2, 9)
    ids[0, 2], ids[0, 3] = 10, 11
    shift = shifted_targets(labels)
    reference = batch_fingerprint({"input_ids": ids}, shift)
    assert torch.equal(batch_fingerprint({"input_ids": ids.clone()}, shift.clone()), reference)
    swapped = ids.clone()
    swapped[0, 2], swapped[0, 3] = 11, 10
    other_targets = shift.clone()
    other_targets[1, 0] = 7 if int(other_targets[1, 0]) != 7 else 8
    for changed in (
        batch_fingerprint({"input_ids": swapped}, shift),
        batch_fingerprint({"input_ids": ids}, other_targets),
        batch_fingerprint({"input_ids": ids[:, :8]}, shift[:, :8]),
    ):
        assert not torch.equal(changed, reference)
