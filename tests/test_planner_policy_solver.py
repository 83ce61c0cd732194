"""The policy solver against brute force over every per-layer assignment, and its errors."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from hf_memo.planner.policy import LayerPolicy
from hf_memo.planner.policy_solver import (
    LayerCosts,
    PolicyDoesNotFit,
    policy_memory,
    policy_seconds,
    solve_policy,
)
from hf_memo.runtime.alpha import solve_offload_fraction


def _random_costs(rng: random.Random) -> LayerCosts:
    return LayerCosts(
        input_bytes=rng.choice([1.0, 2.0, 3.0]),
        attention_bytes=rng.choice([0.5, 1.0, 2.0]),
        other_bytes=rng.choice([0.0, 2.0, 4.0, 7.0]),
        forward_seconds=rng.uniform(0.5, 2.0),
        backward_seconds=rng.uniform(1.0, 4.0),
        attention_seconds=rng.uniform(0.1, 1.0),
        other_seconds=rng.uniform(0.2, 1.5),
    )


def _brute_force(n, costs, bandwidth, device_budget, host_budget, steps):
    choices = [
        LayerPolicy(keep, host, q / steps) for keep in (True, False) for host in (True, False) for q in range(steps + 1)
    ]
    best = None
    for layers in itertools.product(choices, repeat=n):
        if any(layer.on_host for layer in layers[max(n - 2, 0) :]):
            continue  # the top two stay on the device
        device, host = policy_memory(layers, costs)
        if device > device_budget + 1e-9 or host > host_budget + 1e-9:
            continue
        seconds = policy_seconds(layers, costs, bandwidth)
        best = seconds if best is None else min(best, seconds)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_solver_matches_brute_force_over_every_per_layer_assignment(seed):
    rng = random.Random(seed)
    n, steps = rng.choice([(1, 2), (2, 2), (3, 2), (4, 2), (4, 1), (5, 1), (3, 3)])
    costs = _random_costs(rng)
    bandwidth = rng.choice([0.5, 2.0, 10.0])
    device_budget = rng.uniform(0, n * 8 + 10)
    host_budget = rng.uniform(0, n * 8)
    expected = _brute_force(n, costs, bandwidth, device_budget, host_budget, steps)
    if expected is None:
        with pytest.raises(PolicyDoesNotFit):
            solve_policy(n, costs, bandwidth, device_budget, host_budget, steps)
        return
    policy = solve_policy(n, costs, bandwidth, device_budget, host_budget, steps)
    assert policy.predicted_step_seconds == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # The policy it returns is what it claims: within budget, of the predicted time, top two on the device.
    assert len(policy.layers) == n
    device, host = policy_memory(policy.layers, costs)
    assert (policy.device_bytes, policy.host_bytes) == (device, host)
    assert device <= device_budget + 1e-9 and host <= host_budget + 1e-9
    assert policy.predicted_step_seconds == pytest.approx(policy_seconds(policy.layers, costs, bandwidth))
    assert not any(layer.on_host for layer in policy.layers[max(n - 2, 0) :])
    assert all(round(layer.alpha * steps, 9) == int(round(layer.alpha * steps)) for layer in policy.layers)


def test_memo_is_the_special_case_with_room_for_attention_everywhere():
    costs = LayerCosts(1.0, 1.0, 4.0, 1.0, 2.0, 0.5, 0.5)
    # Host holds every swapped layer's X + attention and a quarter of the rest; the device only the top two.
    policy = solve_policy(8, costs, bandwidth=100.0, device_budget=4 * 3.0, host_budget=6 * 3.0, alpha_steps=4)
    assert policy.summary() == "6 X+attn/host (alpha 0.25), 2 X+attn/device (alpha 0.25)"
    assert policy.bound == "device memory"
    memo = solve_offload_fraction(8, 2.0, 4.0, 6 * 3.0, bandwidth=100.0, layer_time=1.0, device_budget=4 * 3.0)
    assert (memo.alpha, memo.swapped_layers) == (0.25, 6)


def test_x_only_layers_buy_length_when_attention_does_not_fit():
    costs = LayerCosts(1.0, 1.0, 4.0, 1.0, 2.0, 0.5, 0.5)
    policy = solve_policy(8, costs, bandwidth=100.0, device_budget=4.0, host_budget=6.0, alpha_steps=4)
    assert policy.summary() == "6 X/host, 2 X/device"
    assert policy_memory([LayerPolicy(True, True, 0.0)] * 6 + [LayerPolicy(True, False, 0.0)] * 2, costs)[0] > 4.0


def test_a_budget_that_fits_nothing_names_the_shortfall_in_bytes():
    costs = LayerCosts(2.0**30, 2.0**30, 0.0, 1.0, 2.0, 0.5, 0.5)
    with pytest.raises(
        PolicyDoesNotFit,
        match=r"needs 1\.000 GiB \(1073741824 bytes\) more device memory and "
        r"2\.000 GiB \(2147483648 bytes\) more host memory",
    ) as error:
        solve_policy(8, costs, 1e9, device_budget=3 * 2.0**30, host_budget=4 * 2.0**30, alpha_steps=4)
    assert (error.value.device_shortfall, error.value.host_shortfall) == (2**30, 2 * 2**30)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers must be an int >= 1, got 0"),
        ({"alpha_steps": 0}, "alpha_steps must be an int >= 1, got 0"),
        ({"bandwidth": 0.0}, "bandwidth must be a finite number > 0.0, got 0.0"),
        ({"host_budget": -1.0}, "host_budget must be a finite number >= 0.0, got -1.0"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, message):
    args = {
        "num_layers": 4,
        "costs": LayerCosts(1, 1, 1, 1, 1, 1, 1),
        "bandwidth": 1.0,
        "device_budget": 10.0,
        "host_budget": 10.0,
        "alpha_steps": 2,
    }
    with pytest.raises(ValueError, match=message):
        solve_policy(**{**args, **kwargs})


@pytest.mark.parametrize("device_budget", [8 * 3.0, 8 * 4.0, 8 * 6.0])
def test_without_host_memory_the_bound_names_what_holds_the_bytes(device_budget):
    costs = LayerCosts(1.0, 1.0, 4.0, 1.0, 2.0, 0.5, 0.5)
    policy = solve_policy(8, costs, bandwidth=100.0, device_budget=device_budget, host_budget=0.0, alpha_steps=4)
    assert policy.host_bytes == 0 and not any(layer.on_host for layer in policy.layers)
    assert policy.bound == ("all" if device_budget == 8 * 6.0 else "device memory")


def _costs_fetched_late(ahead: float, streamed: float = 0.0) -> LayerCosts:
    """A layer whose stash (X 4 + attention 2 + alpha * 8 bytes, 1 of the attention streamed) copies in 1 second at
    bandwidth 10, under 2 seconds of backward: all of it hides when fetched ahead."""
    return LayerCosts(4.0, 2.0, 8.0, 1.0, 2.0, 0.5, 0.5, ahead_bytes=ahead, streamed_bytes=streamed)


@pytest.mark.parametrize("keep_attention", [True, False])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_what_the_layer_above_does_not_fetch_ahead_is_charged_at_the_bandwidth(keep_attention, alpha):
    """A host layer's bytes beyond the key-gradient sums the layer above frees (``ahead_bytes``; the streamed
    attention output aside) arrive when its own backward begins: exactly ``late / bandwidth`` more; none late, no
    change; device layers never."""
    whole = _costs_fetched_late(math.inf, streamed=1.0)
    layer = LayerPolicy(keep_attention, True, alpha)
    fetched = whole.stash_bytes(keep_attention, alpha) - (1.0 if keep_attention else 0.0)
    before = whole.layer_seconds(layer, 10.0)
    late = _costs_fetched_late(3.0, streamed=1.0)
    assert late.late_bytes(keep_attention, alpha) == fetched - 3.0 > 0
    assert late.layer_seconds(layer, 10.0) == pytest.approx(before + (fetched - 3.0) / 10.0, rel=1e-12)
    enough = _costs_fetched_late(fetched, streamed=1.0)
    assert enough.late_bytes(keep_attention, alpha) == 0 and enough.layer_seconds(layer, 10.0) == before
    on_device = replace(layer, on_host=False)
    assert late.layer_seconds(on_device, 10.0) == whole.layer_seconds(on_device, 10.0)


def test_the_solver_and_its_predicted_time_see_the_late_bytes():
    """Three host layers and two device layers: the step's predicted time grows by every host layer's late bytes
    over the bandwidth; the solver, still matching brute force, predicts a longer step where bytes come late."""
    layers = (LayerPolicy(True, True, 0.0),) * 3 + (LayerPolicy(True, False, 0.0),) * 2
    whole, late = _costs_fetched_late(math.inf), _costs_fetched_late(1.0)
    assert policy_seconds(layers, late, 10.0) == pytest.approx(policy_seconds(layers, whole, 10.0) + 3 * 5.0 / 10.0)
    for costs in (whole, late):
        policy = solve_policy(5, costs, 10.0, device_budget=40.0, host_budget=30.0, alpha_steps=2)
        assert policy.predicted_step_seconds == pytest.approx(_brute_force(5, costs, 10.0, 40.0, 30.0, 2), rel=1e-9)
    assert (
        solve_policy(5, late, 10.0, 40.0, 30.0, 2).predicted_step_seconds
        > solve_policy(5, whole, 10.0, 40.0, 30.0, 2).predicted_step_seconds
    )


@pytest.mark.parametrize("seed", range(20))
def test_the_solver_matches_brute_force_with_bytes_fetched_late(seed):
    rng = random.Random(1000 + seed)
    n, steps = rng.choice([(2, 2), (3, 2), (4, 2), (4, 1), (3, 3)])
    costs = replace(
        _random_costs(rng), ahead_bytes=rng.choice([0.0, 1.0, 2.5, 4.0]), streamed_bytes=rng.choice([0.0, 0.5])
    )
    bandwidth = rng.choice([0.5, 2.0, 10.0])
    device_budget, host_budget = rng.uniform(0, n * 8 + 10), rng.uniform(0, n * 8)
    expected = _brute_force(n, costs, bandwidth, device_budget, host_budget, steps)
    if expected is None:
        return
    policy = solve_policy(n, costs, bandwidth, device_budget, host_budget, steps)
    assert policy.predicted_step_seconds == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_fetch_split_charges_late_bytes_only_for_a_blocked_backward():
    from hf_memo.planner.policy_solver import fetch_split

    assert fetch_split(False, 10.0, 5.0) == {"ahead_bytes": math.inf, "streamed_bytes": 0.0}
    assert fetch_split(True, 10.0, 5.0) == {"ahead_bytes": 10.0, "streamed_bytes": 5.0}
