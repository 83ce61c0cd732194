"""The memo estimate's alpha grid against the runtime's chunks (the rest of memo_estimate: the estimate tests)."""

import pytest

from hf_memo.integrations.fitted import chunk_rows
from hf_memo.integrations.memo_estimate import MAX_ALPHA_STEPS, alpha_steps
from hf_memo.profiler.shapes import builtin_config
from hf_memo.runtime.alpha import quantise


@pytest.mark.parametrize("seq_len", [2048, 32768, 98304, 131072, 200704, 589824, 1 << 20])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_every_alpha_of_the_grid_is_whole_chunks_of_the_runtime(seq_len, batch_size):
    config = builtin_config("llama-3-8b")
    steps = alpha_steps(config, batch_size, seq_len)
    chunks = -(-seq_len // (chunk_rows(config, "memo", batch_size, seq_len)[0] // batch_size))
    assert 1 <= steps <= MAX_ALPHA_STEPS and chunks % steps == 0
    # the largest such grid: no finer one up to the cap divides the chunks
    assert all(chunks % finer for finer in range(steps + 1, MAX_ALPHA_STEPS + 1))
    for j in range(steps + 1):  # the executor runs each alpha as given: nothing is rounded down
        assert quantise(j / steps, chunks) * steps == j * chunks
