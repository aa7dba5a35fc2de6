"""The split planner (launch/planner.py): pure arithmetic over measured hosts and links."""

from __future__ import annotations

from dataclasses import replace

import pytest

from skippy.launch.planner import BATCH_ROWS, HostCost, LinkCost, ModelCost, plan_split, predict

MB = 1 << 20
# SmolLM2-135M's shape: 30 layers, a head worth 8 of them, rows of 576 values
MODEL = ModelCost(num_layers=30, head_layers=8.0, hidden_size=576, layer_bytes=4 * MB, first_bytes=30 * MB,
                  last_bytes=30 * MB, activation_dtype="f16")
LAN = LinkCost(rtt_s=0.5e-3, bytes_per_s=1e9 / 8)


def host(name: str, row_ms: float = 0.1, memory_mb: float = 10_000) -> HostCost:
    return HostCost(name, row_ms / 1e3, 10 * row_ms / 1e3, 64, memory_mb * MB)


def links(count: int, link: LinkCost = LAN) -> dict:
    return {(i, i + 1): link for i in range(count - 1)}


def test_equal_hosts_split_by_time_with_the_head_on_the_last():
    plan = plan_split(MODEL, [host("a"), host("b")], links(2), use_all_hosts=True)
    assert plan.ranges == ((0, 19), (19, 30))  # 19 layers | 11 + the head's 8: equal forwards
    assert plan.stage_s == pytest.approx((1.9e-3, 1.9e-3))
    # one stream: both forwards, the row's way down (1,152 f16 bytes) and the token's way back
    hops = 0.25e-3 + 1152 / LAN.bytes_per_s + 0.25e-3
    assert plan.hops_s == pytest.approx(hops) and plan.tok_s == pytest.approx(1 / (3.8e-3 + hops))
    slope = (1e-3 - 0.1e-3) / 63  # a layer's time per extra row: the probe's two points
    batch = 38 * (0.1e-3 + (BATCH_ROWS - 1) * slope) + 0.25e-3 + 1152 * 8 / LAN.bytes_per_s + 0.25e-3
    assert plan.batch_tok_s == pytest.approx(BATCH_ROWS / batch)


def test_equal_hosts_that_fit_alone_say_fewer_hosts_are_faster():
    plan = plan_split(MODEL, [host("a"), host("b"), host("c")], links(3))
    assert plan.hosts == (0,) and plan.ranges == ((0, 30),)
    assert "fewer hosts are faster: 1 of 3 (a)" in plan.fewer_hosts and plan.hops_s == 0.0


def test_a_plan_for_three_hosts_where_two_suffice_says_so():
    # each host holds 20 of the 30 layers (and its embedding or head): one is not enough, two are
    small = 30 + 20 * 4 + 1
    hosts = [host("a", memory_mb=small), host("b", memory_mb=small), host("c", memory_mb=small)]
    plan = plan_split(MODEL, hosts, links(3))
    assert len(plan.hosts) == 2 and "2 of 3" in plan.fewer_hosts and "--all-hosts" in plan.fewer_hosts
    assert all(b - a <= 20 for a, b in plan.ranges)
    every = plan_split(MODEL, hosts, links(3), use_all_hosts=True)
    assert every.hosts == (0, 1, 2) and every.token_s > plan.token_s and "as asked" in every.fewer_hosts


def test_a_slow_host_gets_what_the_fast_one_cannot_hold():
    fast, slow = host("fast", 0.1, memory_mb=30 + 24 * 4 + 1), host("slow", 0.4)
    plan = plan_split(MODEL, [fast, slow], links(2))
    assert plan.ranges == ((0, 24), (24, 30))  # the fast host full; the slow one the rest and the head
    equal = predict(MODEL, [fast, slow], links(2), [(0, 19), (19, 30)])
    assert equal.token_s / plan.token_s == pytest.approx((1.9 + 7.6 + 1.0) / (2.4 + 5.6 + 1.0), rel=0.05)


def test_measurement_noise_does_not_move_a_balanced_split():
    plan = plan_split(MODEL, [host("a", 0.100), host("b", 0.101)], links(2), use_all_hosts=True)
    assert plan.ranges == ((0, 19), (19, 30))


def test_a_slow_link_carries_q8_under_auto():
    auto = replace(MODEL, activation_dtype="auto")
    slow = LinkCost(rtt_s=10e-3, bytes_per_s=1e6 / 8)  # 1 Mbit/s: a row in f16 takes 9 ms
    plan = plan_split(auto, [host("a"), host("b")], {(0, 1): slow}, use_all_hosts=True)
    assert plan.hops_s == pytest.approx(5e-3 + 612 / slow.bytes_per_s + 5e-3)  # 612 bytes: the row in q8


def test_nothing_fits():
    with pytest.raises(ValueError, match="fits in none"):
        plan_split(MODEL, [host("a", memory_mb=50), host("b", memory_mb=50)], links(2))


def test_unmeasured_links_are_the_measured_ones_mean():
    far = LinkCost(rtt_s=40e-3, bytes_per_s=0)  # rate unknown: only its latency counts
    plan = plan_split(MODEL, [host("a"), host("b", 0.01), host("c", 0.01)], {(0, 1): far, (1, 2): far},
                      use_all_hosts=True)
    assert plan.hops_s == pytest.approx(3 * 20e-3)  # 0 -> 1 -> 2 -> back to 0, each half a round trip


def test_a_host_under_a_cpu_quota_is_held_to_its_share_of_a_tokens_cpu():
    # full speed 0.1 ms a layer on one thread, a quarter of a core, and 2 ms of CPU a token
    # beside the forward (frames, TLS, the loop)
    capped = HostCost("capped", 0.1e-3, 1e-3, 64, 10_000 * MB, cpu_layer_s=0.1e-3, cpu_share=0.25,
                      token_cpu_s=2e-3)
    fast = host("fast", 0.1)
    equal = predict(MODEL, [fast, capped], links(2), [(0, 19), (19, 30)])
    assert equal.token_s == pytest.approx((19 * 0.1e-3 + 2e-3) / 0.25)  # 3.9 ms of CPU a token, at a quarter
    plan = plan_split(MODEL, [fast, capped], links(2), use_all_hosts=True)
    # the capped stage keeps one layer and the head: (0.9 + 2) ms / 0.25, still the pace, but the least one
    assert plan.ranges == ((0, 29), (29, 30))
    assert plan.token_s == pytest.approx((9 * 0.1e-3 + 2e-3) / 0.25)
    assert "CPU share holds it" in plan.describe(["fast", "capped"])
    unlimited = HostCost("fast", 0.1e-3, 1e-3, 64, 10_000 * MB, cpu_layer_s=0.2e-3, cpu_share=2.0, token_cpu_s=1e-3)
    same = predict(MODEL, [fast, unlimited], links(2), [(0, 19), (19, 30)])
    assert same.token_s == pytest.approx(38 * 0.1e-3 + 0.5e-3 + 1152 / LAN.bytes_per_s)  # the share never binds
