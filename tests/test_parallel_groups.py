"""Sequence-parallel groups and degree checks (multi-process layouts are tested in test_parallel_causal_lm.py)."""

import pytest
import torch.distributed as dist

from hf_memo.parallel.groups import check_not_accelerate_deepspeed_sp, sequence_parallel_groups
from hf_memo.parallel.heads import HeadSplit, check_head_counts


def test_without_a_process_group_the_error_says_how_to_launch():
    assert not dist.is_initialized()
    with pytest.raises(ValueError) as excinfo:
        sequence_parallel_groups(2)
    message = str(excinfo.value)
    assert "MemoConfig.sequence_parallel_size=2" in message and "no process group" in message
    assert "accelerate launch" in message


def test_a_world_size_that_is_not_a_multiple_of_the_degree_is_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"sequence_parallel_size=2 must divide the world size 1 .*accepted: 1"):
            sequence_parallel_groups(2)
        groups = sequence_parallel_groups(1)
        assert (groups.sp_size, groups.sp_rank, groups.dp_size, groups.dp_rank) == (1, 0, 1, 0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "size,heads,kv_heads", [(1, 4, 2), (3, 4, 2), (4, 4, 1), (2, 3, 3), (8, 28, 4), (16, 40, 40), (32, 32, 8)]
)
def test_any_degree_up_to_the_query_heads_is_accepted(size, heads, kv_heads):
    check_head_counts(size, heads, kv_heads)


@pytest.mark.parametrize("size,heads,kv_heads", [(5, 4, 2), (8, 4, 4), (4, 3, 3)])
def test_a_degree_beyond_the_query_heads_names_the_largest_one(size, heads, kv_heads):
    with pytest.raises(ValueError) as excinfo:
        check_head_counts(size, heads, kv_heads)
    message = str(excinfo.value)
    assert f"sequence_parallel_size={size} exceeds the model's num_attention_heads={heads}" in message
    assert message.endswith(f"the largest degree for this model is {heads}")


def test_query_heads_split_in_contiguous_ranges_of_the_ceiling_then_the_floor():
    split = HeadSplit(28, 4, 8)  # Qwen2.5-7B on 8 GPUs: 4 or 3 query heads each, groups of 7 straddle ranks
    assert [len(r) for r in split.queries] == [4] * 4 + [3] * 4
    assert [(r.start, r.stop) for r in split.queries][:2] == [(0, 4), (4, 8)]
    assert [list(r) for r in split.kvs] == [[0], [0, 1], [1], [1, 2], [2], [2, 3], [3], [3]]
    assert split.queries_per_kv(1) == (3, 1) and not split.grouped  # KV heads repeated to one per query head
    assert split.kv_repeats(1) == (3, 1) and split.attended_kv_heads(0) == 4
    assert split.most_query_heads == 4 and split.imbalance == pytest.approx(32 / 28)
    three = HeadSplit(3, 3, 2)
    assert three.queries == (range(0, 2), range(2, 3)) and three.grouped and three.imbalance == pytest.approx(4 / 3)
    # degrees that divide the heads keep grouped-query attention: each rank attends with the KV heads it receives
    for heads, kv_heads, size, attended in [(32, 8, 8, 1), (32, 8, 4, 2), (8, 2, 4, 1), (8, 1, 8, 1)]:
        split = HeadSplit(heads, kv_heads, size)
        assert split.grouped and split.imbalance == 1 and split.attended_kv_heads(0) == attended
    # each rank's heads use their KV heads evenly, but rank 1 receives two KV heads and rank 0 one: repeated
    assert not HeadSplit(6, 2, 4).grouped and HeadSplit(6, 2, 4).attended_kv_heads(0) == 2


def test_deepspeed_sequence_parallelism_configured_by_accelerate_launch_is_refused(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    check_not_accelerate_deepspeed_sp(1)
    with pytest.raises(ValueError, match="already splits the sequence"):
        check_not_accelerate_deepspeed_sp(4)
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "1")
    check_not_accelerate_deepspeed_sp(4)


MEMO_UNDER_ULYSSES = "MemoConfig.recompute='memo' computes attention itself, so DeepSpeed's Ulysses"


def test_memo_under_deepspeed_ulysses_configured_by_accelerate_launch_is_refused_at_apply(monkeypatch):
    import hf_memo
    from tests.conftest import build_model

    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    with pytest.raises(ValueError, match=f"{MEMO_UNDER_ULYSSES}.*hf_memo's own sequence parallelism"):
        hf_memo.apply(build_model("llama"), recompute="memo")
    hf_memo.apply(build_model("llama"), recompute="full")  # its attention calls go through DeepSpeed's


def test_memo_refuses_a_step_once_deepspeed_ulysses_has_replaced_an_attention_function():
    """What ``UlyssesSPAttentionHF.register_with_transformers`` does when the Trainer prepares the model, after
    ``apply``: a function of DeepSpeed's sequence-parallel module stands in transformers' registry."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf_memo
    from tests.conftest import build_model, make_batch

    model = hf_memo.apply(build_model("llama"), recompute="memo")
    ids, labels = make_batch(1, 9)
    model(input_ids=ids, labels=labels).loss.backward()  # before: trains

    def uattn_wrapper(*args, **kwargs):
        raise AssertionError("never called: the memo executor computes attention itself")

    uattn_wrapper.__module__ = "deepspeed.runtime.sequence_parallel.ulysses_sp"
    AttentionInterface.register("hf_memo_test_ulysses", uattn_wrapper)
    try:
        with pytest.raises(ValueError, match=MEMO_UNDER_ULYSSES):
            model(input_ids=ids, labels=labels)
    finally:
        del ALL_ATTENTION_FUNCTIONS._global_mapping["hf_memo_test_ulysses"]
