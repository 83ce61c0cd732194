import math

import pytest

from hf_memo.runtime.alpha import OffloadPlan, quantise, solve_offload_fraction

GiB = 2**30


def test_bandwidth_bound():
    # 10 GB/s for 0.1 s moves 1 GiB-ish: room for the fixed 0.5 GB plus a quarter of 2 GB.
    plan = solve_offload_fraction(
        10, fixed_bytes=0.5e9, other_bytes=2e9, host_limit=1e15, bandwidth=10e9, layer_time=0.1
    )
    assert plan.bound == "bandwidth" and math.isclose(plan.alpha, 0.25) and plan.swapped_layers == 8


def test_host_bound():
    # 8 swapped layers share 12 GB: 1.5 GB each = 0.5 fixed + alpha * 2 -> alpha = 0.5.
    plan = solve_offload_fraction(
        10, fixed_bytes=0.5e9, other_bytes=2e9, host_limit=12e9, bandwidth=1e12, layer_time=1.0
    )
    assert plan.bound == "host memory" and math.isclose(plan.alpha, 0.5)


def test_both_bounds_take_the_tighter_one():
    args = dict(num_layers=10, fixed_bytes=0.5e9, other_bytes=2e9, host_limit=12e9, layer_time=0.1)
    assert solve_offload_fraction(**args, bandwidth=10e9).bound == "bandwidth"  # 0.25 < 0.5
    assert solve_offload_fraction(**args, bandwidth=20e9).bound == "host memory"  # 0.75 > 0.5


def test_unconstrained_offloads_everything_and_impossible_offloads_nothing():
    assert solve_offload_fraction(4, 1.0, 1.0, 1e12, bandwidth=1e12, layer_time=1.0).alpha == 1.0
    assert solve_offload_fraction(4, 1e9, 1e9, 1e12, bandwidth=1e8, layer_time=1.0).alpha == 0.0


def test_requested_alpha_is_kept_or_lowered_with_a_warning():
    assert solve_offload_fraction(10, 0.5e9, 2e9, 1e15, requested=0.75).alpha == 0.75
    with pytest.warns(UserWarning, match="offload_fraction=0.75 needs more host memory"):
        plan = solve_offload_fraction(10, 0.5e9, 2e9, 12e9, requested=0.75)
    assert math.isclose(plan.alpha, 0.5) and plan.bound == "host memory"


def test_layers_that_do_not_fit_stay_on_the_device():
    with pytest.warns(UserWarning, match="holds the layer inputs and attention outputs of 3 of 8 layers"):
        plan = solve_offload_fraction(10, fixed_bytes=1 * GiB, other_bytes=1 * GiB, host_limit=3.5 * GiB)
    assert plan.swapped_layers == 3 and 0 <= plan.alpha < 0.2


def test_quantise_rounds_down_to_the_chunk_grid():
    assert quantise(0.49, 4) == 1 and quantise(0.5, 4) == 2 and quantise(1.0, 3) == 3 and quantise(0.0, 8) == 0
    assert quantise(1 / 8, 8) == 1


def test_the_device_budget_lowers_an_alpha_bandwidth_would_allow():
    # 10 layers, 8 swapped: the device holds the 2 top layers' stashes and 2 rounding (or prefetch) buffers,
    # 4 x (1 GB + alpha x 4 GB). Bandwidth and host would take alpha = 1; 12 GB of device budget allow 0.5.
    args = dict(num_layers=10, fixed_bytes=1e9, other_bytes=4e9, host_limit=1e15, bandwidth=1e12, layer_time=1.0)
    assert solve_offload_fraction(**args) == OffloadPlan(1.0, 8, "all")
    plan = solve_offload_fraction(**args, device_budget=12e9)
    assert plan.bound == "device memory" and math.isclose(plan.alpha, 0.5) and plan.swapped_layers == 8
    assert solve_offload_fraction(**args, device_budget=20e9).alpha == 1.0  # 4 x 5 GB fit


def test_layers_the_host_cannot_take_count_against_the_device_budget():
    # The host holds 3 of 8 layers: 5 + 2 layers stay on the device, plus 2 buffers: 9 x (1 + alpha x 1) GiB.
    with pytest.warns(UserWarning, match="3 of 8 layers"):
        plan = solve_offload_fraction(10, GiB, GiB, 3.5 * GiB, bandwidth=1e15, layer_time=1.0, device_budget=13.5 * GiB)
    assert plan.swapped_layers == 3 and plan.bound == "host memory"  # host: 3.5 / 3 - 1 = 0.17 < device: 0.5
    plan = solve_offload_fraction(10, GiB, GiB, 1e15, bandwidth=1e15, layer_time=1.0, device_budget=5 * GiB)
    assert plan.bound == "device memory" and math.isclose(plan.alpha, 0.25)  # 4 x (1 + 0.25) = 5


def test_a_requested_alpha_the_device_cannot_hold_is_lowered_and_an_impossible_budget_warns():
    with pytest.warns(UserWarning, match="offload_fraction=0.75 needs more device memory than the limit allows"):
        plan = solve_offload_fraction(10, 1e9, 4e9, 1e15, requested=0.75, device_budget=12e9)
    assert plan == OffloadPlan(0.5, 8, "device memory")
    with pytest.warns(UserWarning, match="cannot hold the layer inputs and attention outputs the device keeps"):
        plan = solve_offload_fraction(10, 1e9, 4e9, 1e15, bandwidth=1e12, layer_time=1.0, device_budget=3e9)
    assert plan.alpha == 0.0 and plan.bound == "device memory"


def test_alpha_is_rounded_down_to_whole_chunks():
    args = dict(num_layers=10, fixed_bytes=0.5e9, other_bytes=2e9, host_limit=1e15, layer_time=0.1)
    assert solve_offload_fraction(**args, bandwidth=10e9, chunks=3).alpha == 0.0  # 0.25 of 3 chunks: none
    assert solve_offload_fraction(**args, bandwidth=10e9, chunks=8) == OffloadPlan(0.25, 8, "bandwidth")
    assert solve_offload_fraction(**args, bandwidth=20e9, chunks=2).alpha == 0.5  # 0.75 of 2 chunks: one
    assert solve_offload_fraction(10, 0.5e9, 2e9, 1e15, requested=0.5, chunks=3) == OffloadPlan(1 / 3, 8, "requested")


def test_without_a_swapped_layer_the_bound_is_never_host_memory():
    # Two layers: none is swapped, nothing is copied; only the device budget (or the request) bounds alpha.
    assert solve_offload_fraction(2, 1e9, 4e9, 1e15, bandwidth=1e3, layer_time=1.0) == OffloadPlan(1.0, 0, "all")
    assert solve_offload_fraction(2, 1e9, 4e9, 0, device_budget=6e9) == OffloadPlan(0.5, 0, "device memory")
    with pytest.warns(UserWarning, match="holds the layer inputs and attention outputs of 0 of 8 layers"):
        plan = solve_offload_fraction(10, 1e9, 4e9, 0.5e9, requested=0.25)
    assert plan == OffloadPlan(0.25, 0, "requested")
