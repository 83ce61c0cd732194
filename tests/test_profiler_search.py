import pytest

from hf_memo.profiler.search import longest_fitting


class Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, seq_len):
        self.calls += 1
        return self.fn(seq_len)


@pytest.mark.parametrize("start", [256, 4096, 100_000, 900_000])
def test_finds_the_last_fitting_multiple_with_few_probes_for_an_affine_usage(start):
    usage = Counted(lambda s: 0.8 + s / 300_000)  # fits up to 60,000 tokens
    assert longest_fitting(usage, start) == 59_904
    assert usage.calls <= 8


def test_piecewise_usage_with_a_kink_still_gives_the_boundary():
    usage = Counted(lambda s: 0.1 + s / 50_000 if s < 30_000 else 0.1 + 0.6 + (s - 30_000) / 5_000)
    expected = 30_000 + int(0.3 * 5_000)  # 31,500
    assert longest_fitting(usage, 8192) == expected // 256 * 256
    assert usage.calls <= 16


def test_nothing_fits_and_everything_fits():
    assert longest_fitting(lambda s: 1.5, 4096) == 0
    assert longest_fitting(lambda s: 0.5, 4096, limit=1 << 20) == 1 << 20


def test_bad_arguments():
    with pytest.raises(ValueError, match="granularity"):
        longest_fitting(lambda s: 0.5, 1, granularity=0)
