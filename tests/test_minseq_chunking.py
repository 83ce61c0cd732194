import pytest
from hypothesis import given
from hypothesis import strategies as st

from hf_memo.minseq.chunking import auto_chunks, chunk_bounds, resolve_chunks


@given(rows=st.integers(0, 5000), chunks=st.integers(1, 300))
def test_bounds_cover_every_row_once_in_order(rows, chunks):
    bounds = chunk_bounds(rows, chunks)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    for (_, stop), (start, _) in zip(bounds, bounds[1:]):
        assert stop == start
    sizes = [b - a for a, b in bounds]
    assert len(bounds) == max(1, min(chunks, rows))
    assert max(sizes) - min(sizes) <= 1


def test_tail_is_kept_when_chunks_do_not_divide():
    assert chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(7, 7) == [(i, i + 1) for i in range(7)]
    assert chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]


def test_bad_chunk_count_is_rejected():
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        chunk_bounds(10, 0)


def test_auto_follows_width_over_hidden_for_long_sequences():
    # Llama-3-8B: I / H = 3.5 -> 4 MLP chunks; V / H = 31.3 -> 32 LM-head chunks.
    assert auto_chunks(65536, 14336, 4096, 1024) == 4
    assert auto_chunks(65536, 128256, 4096, 1024) == 32


def test_auto_keeps_short_sequences_whole():
    assert auto_chunks(512, 14336, 4096, 1024) == 1
    assert auto_chunks(1023, 128256, 4096, 1024) == 1
    # Never shorter than min_chunk_tokens: 8192 tokens allow at most 8 chunks.
    assert auto_chunks(8192, 128256, 4096, 1024) == 8


def test_auto_prefers_a_count_that_divides_the_tokens():
    # GPT-7B: I / H = 2.7 -> 3 chunks would be uneven on 32768 tokens; 4 divides them.
    assert auto_chunks(32768, 11008, 4096, 1024) == 4
    assert auto_chunks(30000, 11008, 4096, 1024) == 3  # 3 divides 30000
    assert auto_chunks(32771, 11008, 4096, 1024) == 3  # a prime: no even split within 2x, keep the target


def test_resolve_passes_explicit_counts_through():
    assert resolve_chunks(5, 10, 100, 10, 1024) == 5
    assert resolve_chunks("auto", 65536, 14336, 4096, 1024) == 4
