import pytest
from hypothesis import given
from hypothesis import strategies as st

from hf_memo.config import MemoConfig
from hf_memo.minseq.chunking import auto_chunks, chunk_bounds, resolve_chunks

CAP = 2**28  # the rule at a given cap (the default's own counts: test_the_default_cap_...)


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
    assert auto_chunks(65536, 14336, 4096, 1024, CAP) == 4
    assert auto_chunks(65536, 128256, 4096, 1024, CAP) == 32


def test_auto_keeps_short_sequences_whole():
    assert auto_chunks(512, 14336, 4096, 1024, CAP) == 1
    assert auto_chunks(1023, 128256, 4096, 1024, CAP) == 1
    # Never shorter than min_chunk_tokens: 8192 tokens allow at most 8 chunks.
    assert auto_chunks(8192, 128256, 4096, 1024, CAP) == 8


def test_auto_prefers_a_count_that_divides_the_tokens():
    # GPT-7B: I / H = 2.7 -> 3 chunks would be uneven on 32768 tokens; 4 divides them.
    assert auto_chunks(32768, 11008, 4096, 1024, CAP) == 4
    assert auto_chunks(30000, 11008, 4096, 1024, CAP) == 3  # 3 divides 30000
    assert auto_chunks(32771, 11008, 4096, 1024, CAP) == 3  # a prime: no even split within 2x, keep the target


@pytest.mark.parametrize("tokens", [2**17, 2**19, 2**20, 1_000_003])
@pytest.mark.parametrize("width", [14336, 128256])
def test_auto_grows_the_chunk_count_with_the_sequence_so_a_chunk_stays_bounded(tokens, width):
    chunks = auto_chunks(tokens, width, 4096, 1024, CAP)
    largest = max(stop - start for start, stop in chunk_bounds(tokens, chunks))
    assert largest * width <= CAP  # at any length
    assert largest >= 1024


def test_auto_chunk_counts_for_llama_3_at_one_million_tokens():
    # The MsT rule alone gives 4 and 32 chunks: 32768 tokens x 128256 logits (16 GiB in float32) per chunk.
    assert auto_chunks(2**20, 14336, 4096, 1024, CAP) == 64
    assert auto_chunks(2**20, 128256, 4096, 1024, CAP) == 512


def test_min_chunk_tokens_wins_over_the_element_cap():
    assert auto_chunks(8192, 128256, 4096, 1024, 2**20) == 8  # the cap alone would want 8192 / 8 = 1024 chunks


def test_resolve_passes_explicit_counts_through():
    assert resolve_chunks(5, 10, 100, 10, 1024, CAP) == 5
    assert resolve_chunks("auto", 65536, 14336, 4096, 1024, CAP) == 4


def test_the_default_cap_cuts_llama_3_8b_into_4096_token_mlp_and_1024_token_head_chunks_on_long_sequences():
    """2^26 elements: a chunk's MLP intermediate at most 128 MiB in bf16, an LM-head chunk 256 MiB of fp32 logits (the
    memo executor's working set at 262,144 tokens holds one chunk's MLP backward)."""
    cap = MemoConfig().max_chunk_elements
    assert cap == 2**26
    assert auto_chunks(262144, 14336, 4096, 1024, cap) == 64
    assert auto_chunks(262144, 128256, 4096, 1024, cap) == 256
    assert auto_chunks(2**20, 14336, 4096, 1024, cap) == 256
    assert auto_chunks(2**20, 128256, 4096, 1024, cap) == 1024  # min_chunk_tokens: never under 1,024 tokens
    assert auto_chunks(16384, 14336, 4096, 1024, cap) == 4  # where the cap does not bind, the MsT rule
