"""bench/cluster.py's pure parts: the communication bounds (bench/physics.py) it prints next to its
measurements, its --rate parsing (tc's units) and what each system's name asks of compression."""

from __future__ import annotations

import pytest

from bench.cluster import (
    BOTH_WAYS,
    LOCAL_SYSTEMS,
    SYSTEMS,
    compressed_system,
    emulated_compute_bound,
    known_system,
    of_bound,
    rate_bit_s,
    rates_by_n,
    run_system,
)
from bench.physics import comm_bounds_s, local_step_bounds_s


def test_bounds_at_200_mbit() -> None:
    p = 669_706 * 4  # the MLP 784-512-512-10 in fp32
    one = p * 8 / 200e6  # 107 ms: one model through one 200 Mbit/s link
    b2, b8 = comm_bounds_s(2, p, 200e6), comm_bounds_s(8, p, 200e6)
    assert b2["ring_allreduce_s"] == pytest.approx(one)
    assert b8["ring_allreduce_s"] == pytest.approx(1.75 * one)
    assert b8["single_server_sequential_s"] == pytest.approx(16 * one)
    assert b8["single_server_full_duplex_s"] == pytest.approx(8 * one)
    # the single server's disadvantage grows as N^2/(N-1): 4.6x at N = 8 (the figure)
    assert b8["single_server_full_duplex_s"] / b8["ring_allreduce_s"] == pytest.approx(64 / 7 / 2)
    assert b8["single_server_sequential_s"] / b8["ring_allreduce_s"] == pytest.approx(64 / 7)


def test_one_host_needs_no_ring_traffic() -> None:
    assert comm_bounds_s(1, 1000, 1e6)["ring_allreduce_s"] == 0


@pytest.mark.parametrize("args", [(0, 10, 1.0), (2, 0, 1.0), (2, 10, 0.0)])
def test_bad_arguments_are_refused(args) -> None:
    with pytest.raises(ValueError, match="need n >= 1"):
        comm_bounds_s(*args)


def test_rates_in_tc_units() -> None:
    assert rate_bit_s("200mbit") == 200e6
    assert rate_bit_s("1.5Gbit") == 1.5e9
    assert rate_bit_s("800kbit") == 800e3
    with pytest.raises(ValueError, match="e.g. 200mbit"):
        rate_bit_s("200MB/s")


def test_one_rate_or_one_per_n() -> None:
    assert rates_by_n("200mbit", [2, 4]) == {2: "200mbit", 4: "200mbit"}
    assert rates_by_n("2:200mbit,4:100mbit,8:50mbit", [2, 8]) == {2: "200mbit", 4: "100mbit", 8: "50mbit"}
    with pytest.raises(ValueError, match=r"no rate for N = \[8\]"):
        rates_by_n("2:200mbit,4:100mbit", [2, 4, 8])
    with pytest.raises(ValueError, match="e.g. 200mbit"):
        rates_by_n("2:200MB/s", [2])
    with pytest.raises(ValueError):
        rates_by_n("two:200mbit", [2])


def test_system_names_say_codec_downlink_and_rank() -> None:
    assert compressed_system("cmemi_kn") == {"codec": "none", "downlink": "none", "rank": 2}
    assert compressed_system("cmemi_k1_powersgd") == {"codec": "powersgd", "downlink": "none", "rank": 2}
    assert compressed_system("cmemi_kn_topk2") == {"codec": "topk", "downlink": "topk", "rank": 2}
    assert compressed_system("cmemi_kn_dedicated_powersgd_sign") == {"codec": "powersgd", "downlink": "sign", "rank": 2}
    assert compressed_system("cmemi_k1_powersgd2_r8") == {"codec": "powersgd", "downlink": "powersgd", "rank": 8}
    both = {k for k in SYSTEMS if compressed_system(k)["downlink"] != "none" and k.startswith("cmemi")}
    assert both == set(BOTH_WAYS) and "cmemi_kn_dedicated_powersgd2_r8" in both


def test_local_steps_against_the_compute_bound() -> None:
    # N replicas each sleep 20 ms per inner step of 64 samples: 8 · 64 / 0.02 = 25 600 samples/s at N = 8
    assert emulated_compute_bound(8, 20.0) == pytest.approx(25_600)
    assert emulated_compute_bound(16, 20.0) == pytest.approx(2 * emulated_compute_bound(8, 20.0))
    assert of_bound({"samples_per_s": 12_800.0}, emulated_compute_bound(8, 20.0)) == 0.5
    assert of_bound({"error": "failed"}, 25_600.0) is None
    assert of_bound({"samples_per_s": 100.0}, None) is None


def test_local_step_bounds_follow_where_the_states_go() -> None:
    p, mbit50 = 2_678_824, 50e6  # the sleepy MLP in fp32; SGD with momentum: a state is P
    ingress = 7 / 8 * p * 8 / mbit50  # a host's slices of the changes (or of the parameters) at N = 8
    whole = local_step_bounds_s(8, p, p, mbit50, 4.0)
    assert whole["no_states_s"] == pytest.approx(4.0 + 2 * ingress)
    assert whole["leader_s"] == pytest.approx(whole["no_states_s"] + 7 * p * 8 / mbit50)  # 7 hosts' states, in series
    assert whole["spread_s"] == pytest.approx(whole["no_states_s"] + 7 / 8 * p * 8 / mbit50)
    assert whole["after_change_s"] == pytest.approx(whole["no_states_s"])  # 7 states fit in a round's compute
    assert local_step_bounds_s(8, p, p, 20e6, 4.0)["after_change_s"] == pytest.approx(7 * p * 8 / 20e6)  # they do not
    # streaming, F = 4: R / 3 snapshots a segment, each the inner state and the replica's parameters; overlapped
    stream = local_step_bounds_s(8, p, p, mbit50, 1.0, fragments=4)
    assert stream["leader_s"] == pytest.approx((2 * ingress / 4 * mbit50 / 8 + 7 / 3 * 2 * p) * 8 / mbit50)
    assert stream["spread_s"] == stream["no_states_s"] == 1.0  # the link's share fits under the compute
    assert "after_change_s" not in stream
    with pytest.raises(ValueError, match="need n >= 1"):
        local_step_bounds_s(8, p, p, mbit50, 1.0, fragments=0)


def test_whole_rounds_with_a_downlink_run_int8_both_ways() -> None:
    """cmemi_local_int8_down is cmemi_local (K = N, N replicas, rounds a quarter of --steps) with int8 changes up and
    compression.downlink int8; it is a local-steps system (compute bounds recorded); its _nolog variant turns the step
    log off (the log's cost with local steps: each step's entries carry the replicas' states to the checkpointer)."""
    calls = []

    class Recorder:
        def cmemi(self, *args, **kwargs):
            calls.append((args, kwargs))
            return {}

    run_system(Recorder(), "cmemi_local_int8_down", 4, 40, 4, 0, local_steps=200)  # type: ignore[arg-type]
    run_system(Recorder(), "cmemi_local", 4, 40, 4, 0, local_steps=200)  # type: ignore[arg-type]
    run_system(Recorder(), "cmemi_local_stream_nolog", 4, 40, 4, 0, local_steps=200)  # type: ignore[arg-type]
    (args, kwargs), (plain_args, plain), (_, nolog) = calls
    assert args == (4, 10, 2, "int8") and kwargs == {"shards": 4, "local_steps": 200, "downlink": "int8",
                                                     "inner_states": "shards", "pace": True, "step_log": True}
    assert nolog["step_log"] is False and nolog["fragments"] == 4
    assert plain_args == (4, 10, 2, "none") and plain.get("downlink", "none") == "none"
    assert "cmemi_local_int8_down" in LOCAL_SYSTEMS and known_system("cmemi_local_int8_down")
    assert known_system("cmemi_local_int8_down_nolog") and not known_system("cmemi_kn_pipelined_nolog")
