import pytest

from hf_memo.runtime.buckets import bucket_length, stretch


@pytest.mark.parametrize("seq_len", [1, 17, 63, 64, 65, 1000, 1023, 1024, 1025, 131_071, 131_073, 999_999])
def test_a_bucket_holds_its_length_wastes_under_a_32nd_and_is_its_own_bucket(seq_len):
    bucket = bucket_length(seq_len)
    assert seq_len <= bucket < seq_len * (1 + 1 / 32) and bucket_length(bucket) == bucket
    assert stretch(seq_len) == bucket / seq_len


def test_short_lengths_are_exact_and_nearby_long_ones_share_a_bucket():
    assert [bucket_length(s) for s in (5, 63)] == [5, 63]
    assert {bucket_length(s) for s in range(993, 1009)} == {1008}
    assert bucket_length(1009) == 1024 and bucket_length(131_072) == 131_072
