"""The memo estimate's alpha grid against the runtime's chunks (the rest of memo_estimate: the estimate tests)."""

import pytest
from transformers import LlamaConfig

from hf_memo.estimator.fitted import chunk_rows
from hf_memo.estimator.memo_policy import MAX_ALPHA_STEPS, alpha_steps, backward_in_blocks
from hf_memo.estimator.time_model import Gpu, LayerFlops, attention_imbalance, step_seconds
from hf_memo.profiler.shapes import builtin_config
from hf_memo.runtime.alpha import quantise
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.blocked_attention import blockable


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


def test_the_busiest_rank_of_an_uneven_head_split_bounds_attention_time():
    """Qwen2.5-7B (28 query heads) on 8 ranks: rank 0 attends with 4 heads where an even split would be 3.5; the
    matmuls stay split evenly by tokens."""
    qwen = LlamaConfig(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4)
    assert attention_imbalance(qwen, 1) == attention_imbalance(qwen, 4) == attention_imbalance(qwen, 7) == 1.0
    assert attention_imbalance(qwen, 8) == pytest.approx(8 / 7)
    flops = LayerFlops(matmul_weights=1000, trainable_weights=1000, attention_width=3584)
    even, uneven = flops.seconds(1, 4096, 1e12), flops.seconds(1, 4096, 1e12, 8 / 7)
    assert uneven[2] == pytest.approx(even[2] * 8 / 7)  # the attention core's forward
    matmuls = 2.0 * 1000 * 4096 / 1e12
    assert uneven[0] - matmuls == pytest.approx((even[0] - matmuls) * 8 / 7)
    gpu = Gpu("test", 1e12, 1e9)
    assert step_seconds("vanilla", flops, 2, 0.0, 1, 4096, gpu, 8 / 7) > step_seconds(
        "vanilla", flops, 2, 0.0, 1, 4096, gpu
    )


@pytest.mark.parametrize("window", [None, 512, 4096])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("sequence_parallel", [1, 2])
def test_the_cost_models_blocked_backward_is_the_runtimes_rule(window, dropout, sequence_parallel):
    """The solver's time model fetches a layer ahead as the executor will: in blocks of queries exactly where the
    runtime's :func:`blockable` says so (attention dropout or a window that hides keys: whole), on one rank."""
    config = LlamaConfig(sliding_window=window, attention_dropout=dropout)
    for seq_len in (1000, 4096, 9000):
        runtime = sequence_parallel == 1 and blockable(seq_len, AttentionTraits(1.0, dropout, window))
        assert backward_in_blocks(config, seq_len, sequence_parallel) == runtime
