import warnings

import pytest

from hf_memo.config import MemoConfig, MemoConfigWarning


def test_defaults_are_valid_and_serialisable():
    config = MemoConfig()
    assert config.mlp_chunks == "auto" and config.recompute == "none"
    assert config.to_dict()["lm_head_chunks"] == "auto"
    assert config.host_memory_limit_bytes is None


@pytest.mark.parametrize(
    "field,value,accepted",
    [
        ("mlp_chunks", 0, '"auto" or an int >= 1'),
        ("mlp_chunks", "many", '"auto" or an int >= 1'),
        ("lm_head_chunks", 2.5, '"auto" or an int >= 1'),
        ("lm_head_chunks", True, '"auto" or an int >= 1'),
        ("min_chunk_tokens", 0, "an int >= 1"),
        ("max_chunk_elements", 0, "an int >= 1"),
        ("max_chunk_elements", 2.0**28, "an int >= 1"),
        ("recompute", "everything", 'one of "none", "full", "selective", "memo"'),
        ("offload_fraction", 1.5, '"auto" or a float in [0, 1]'),
        ("offload_fraction", -0.1, '"auto" or a float in [0, 1]'),
        ("host_memory_limit", "lots", '"auto", a byte count >= 0 or a size such as "64GiB"'),
        ("host_memory_limit", -1, '"auto", a byte count >= 0 or a size such as "64GiB"'),
        ("device_memory_limit", "most", '"auto", a byte count >= 0 or a size such as "70GiB"'),
        ("device_memory_limit", -1, '"auto", a byte count >= 0 or a size such as "70GiB"'),
        ("layer_time", 0, "None or a number > 0"),
        ("host_bandwidth", -2.0, "None or a number > 0"),
        ("planner", "ilp", 'one of "off", "greedy", "cpsat", "mip", "gurobi"'),
        ("planner_time_limit", 0, "a number of seconds > 0"),
        ("sequence_parallel_size", 0, "an int >= 1"),
    ],
)
def test_bad_values_name_field_value_and_accepted(field, value, accepted):
    with pytest.raises(ValueError) as excinfo:
        MemoConfig(**{field: value})
    message = str(excinfo.value)
    assert message == f"MemoConfig.{field} must be {accepted}, got {value!r}"


def test_host_memory_limit_accepts_sizes():
    assert MemoConfig(recompute="memo", host_memory_limit="64GiB").host_memory_limit_bytes == 64 * 2**30
    assert MemoConfig(recompute="memo", host_memory_limit=10**9).host_memory_limit_bytes == 10**9


def test_device_memory_limit_accepts_sizes_and_defaults_to_auto():
    assert MemoConfig().device_memory_limit == "auto" and MemoConfig().device_memory_limit_bytes is None
    assert MemoConfig(recompute="memo", device_memory_limit="70GiB").device_memory_limit_bytes == 70 * 2**30
    assert MemoConfig(recompute="memo", device_memory_limit=10**9).device_memory_limit_bytes == 10**9


def test_replace_validates_and_rejects_unknown_fields():
    config = MemoConfig().replace(mlp_chunks=8)
    assert config.mlp_chunks == 8
    with pytest.raises(ValueError, match="MemoConfig.mlp_chunks must be"):
        config.replace(mlp_chunks=-1)
    with pytest.raises(ValueError, match="unknown MemoConfig field"):
        config.replace(chunks=8)


def test_config_is_immutable():
    with pytest.raises(AttributeError):
        MemoConfig().mlp_chunks = 3


@pytest.mark.parametrize("planner", ["off", "greedy", "cpsat", "mip", "gurobi"])
def test_every_planner_is_accepted(planner):
    assert MemoConfig(recompute="memo", planner=planner).planner == planner


@pytest.mark.parametrize("size", [1, 2, 8])
def test_sequence_parallel_size_accepts_any_positive_int(size):
    assert MemoConfig(sequence_parallel_size=size).sequence_parallel_size == size


@pytest.mark.parametrize("value", [-2, 1.0, "2", True])
def test_sequence_parallel_size_refuses_non_positive_or_non_int(value):
    with pytest.raises(ValueError, match=r"MemoConfig.sequence_parallel_size must be an int >= 1, got"):
        MemoConfig(sequence_parallel_size=value)


@pytest.mark.parametrize("field", ["host_memory_limit", "device_memory_limit"])
def test_a_size_without_its_unit_is_refused_with_the_fix(field):
    with pytest.raises(ValueError, match=f'^MemoConfig.{field}=64 is 64 bytes; write "64GiB"'):
        MemoConfig(recompute="memo", **{field: 64})
    with pytest.raises(ValueError, match=f'^MemoConfig.{field}="80" has no unit: write "80GiB" .* or "80GB"'):
        MemoConfig(recompute="memo", **{field: "80"})
    sizes = {64 * 2**30: 64 * 2**30, 2**20: 2**20, 0: 0, "0": 0, "512B": 512, "1.5GB": 1_500_000_000}
    for value, expected in sizes.items():
        assert getattr(MemoConfig(recompute="memo", **{field: value}), f"{field}_bytes") == expected


def test_an_offload_fraction_without_memo_is_an_error():
    for recompute in ("none", "full", "selective"):
        with pytest.raises(
            ValueError,
            match=f"offload_fraction=0.5 offloads tokens under recompute='memo' only; "
            f"recompute='{recompute}' offloads nothing",
        ):
            MemoConfig(recompute=recompute, offload_fraction=0.5)
    assert MemoConfig(recompute="memo", offload_fraction=0.5).offload_fraction == 0.5


@pytest.mark.parametrize(
    "settings,inert",
    [
        (dict(planner="cpsat"), "planner='cpsat' does nothing with recompute='none'"),
        (
            dict(recompute="full", host_memory_limit="64GiB"),
            "host_memory_limit='64GiB' does nothing with recompute='full'",
        ),
        (dict(recompute="selective", device_memory_limit="70GiB"), "device_memory_limit='70GiB' does nothing"),
        (dict(recompute="memo", offload_fraction=0.5, layer_time=1.0), "layer_time=1.0 does nothing with offload_fr"),
        (dict(recompute="memo", host_bandwidth=1e9, offload_fraction=0.0), "host_bandwidth=1000000000.0 does nothing"),
        (dict(recompute="memo", planner_time_limit=2.5), "planner_time_limit=2.5 does nothing with planner='off'"),
        (dict(mlp_chunks=2, lm_head_chunks=3, min_chunk_tokens=64), "min_chunk_tokens=64 does nothing with fixed"),
    ],
)
def test_a_setting_that_does_nothing_warns(settings, inert):
    with pytest.warns(MemoConfigWarning, match=f"^MemoConfig.{inert}"):
        MemoConfig(**settings)


def test_settings_that_act_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemoConfig(recompute="memo", planner="cpsat", planner_time_limit=2.5, host_memory_limit="64GiB")
        MemoConfig(recompute="memo", offload_fraction=0.5, device_memory_limit="70GiB")
        MemoConfig(recompute="memo", layer_time=1.0, host_bandwidth=1e9)
        MemoConfig(mlp_chunks=2, min_chunk_tokens=64)  # the LM head's count is "auto"
        MemoConfig(recompute="full", mlp_chunks=4, lm_head_chunks=4)
