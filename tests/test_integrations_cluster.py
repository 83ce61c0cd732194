import pytest

from hf_memo.integrations.cluster import Cluster, ModelStates, all_to_all_bytes, rank_peak
from hf_memo.profiler.analysis import Peak
from hf_memo.profiler.shapes import builtin_config

GiB = 2**30
STATES = ModelStates(16 * GiB, 16 * GiB, 32 * GiB, GiB, GiB)
PEAK = Peak(
    100 * GiB,
    {
        "parameter": 16 * GiB,
        "buffer": 0,
        "gradient": 16 * GiB,
        "optimizer": 32 * GiB,
        "activation": 30 * GiB,
        "temporary": 6 * GiB,
    },
)


@pytest.mark.parametrize(
    "zero,offload,parameter,gradient,optimizer,host",
    [
        (0, False, 16, 16, 32, 0),
        (1, False, 16, 16, 4, 0),
        (2, False, 16, 3, 4, 0),
        (3, False, 4, 3, 4, 0),
        (3, True, 4, 1, 0, 6),
    ],
)
def test_zero_stages_shard_the_model_states(zero, offload, parameter, gradient, optimizer, host):
    device, on_host = rank_peak(PEAK, STATES, Cluster(8, 8, zero, offload))
    assert device.by_category["parameter"] == parameter * GiB
    assert device.by_category["gradient"] == gradient * GiB
    assert device.by_category["optimizer"] == optimizer * GiB
    assert on_host == host * GiB
    assert device.total == sum(device.by_category.values())


def test_all_to_all_buffers_and_bad_values():
    config = builtin_config("llama-3-8b")  # 32 heads of 128, 8 kv heads
    assert all_to_all_bytes(config, Cluster(8, 1), 1, 1024, 2) == 0
    # one rank: S positions of 4 query heads and 1 kv head, q + out and k + v, bf16
    assert all_to_all_bytes(config, Cluster(8, 8), 1, 1024, 2) == (2 * 4 * 128 + 2 * 1 * 128) * 1024 * 2
    assert Cluster(16, 8).ranks_per_node == 8 and Cluster(2).ranks_per_node == 2
    assert Cluster(8, 8).rank_seq_len(1000) == 125
    with pytest.raises(ValueError, match="zero must be one of 0, 1, 2, 3, got 5"):
        Cluster(zero=5)
    with pytest.raises(ValueError, match="sequence_parallel must divide num_gpus"):
        Cluster(8, 3)
