"""The step-time model's arithmetic (reduction_server/tools/pool_model.py, peer_model.py,
step_model.py) on cases worked by hand, with the real chunk planner."""

from __future__ import annotations

import pytest

from reduction_server.client.chunking import plan_chunks
from reduction_server.tools import peer_model, pool_model
from reduction_server.tools.measured_costs import GIB, Costs
from reduction_server.tools.network_model import ETHERNET_BYTES, TCP_IP_BYTES, Network, payload_share
from reduction_server.tools.pool_model import ZMTP_FRAMING, Chunking, Timing
from reduction_server.tools.step_model import BACKWARD_SHARE, StepShape, step_time
from reduction_server.wire.protocol import HEADER_SIZE

MiB = 1 << 20
CHUNKING = Chunking(chunk_bytes=4 * MiB, depth=32, window=4)
FREE = Costs(0.0, 0.0, 0.0, 0.0)  # no CPU: the links alone
PER_MESSAGE = TCP_IP_BYTES + ETHERNET_BYTES


def wire(payload: float, messages: int) -> float:
    """Link bytes by hand: 1514 link bytes carry 1448 of payload, plus a frame's headers a message."""
    return payload * 1514 / 1448 + messages * PER_MESSAGE


def test_payload_share_is_a_full_segment_of_an_ethernet_frame():
    assert payload_share() == pytest.approx(1448 / 1514)


def test_one_worker_sends_its_buffer_up_and_gets_it_back_once():
    # W=1, R=1 at 1 Gbit/s, 4 MiB float32: 32 chunks of 128 KiB (R x depth), links alone.
    net = Network.symmetric(1, 1, 1.0, 1.0)
    t = pool_model.allreduce(net, MiB, 4, plan_chunks, CHUNKING, FREE)
    assert (t.chunks, t.chunk_bytes) == (32, 128 * 1024)
    link = wire(4 * MiB + 32 * (HEADER_SIZE + ZMTP_FRAMING), 32) / 125e6
    assert t.limits["worker link"] == pytest.approx(link)
    assert t.limits["reducer link"] == pytest.approx(link)  # one worker: the reducer carries the same
    assert t.binds == "worker link"  # a tie goes to the first named
    # lag: one chunk over the reducer's link (W=1), no burst, no round trip
    assert t.lag_s == pytest.approx(wire(128 * 1024 + HEADER_SIZE + ZMTP_FRAMING, 1) / 125e6)


def test_one_slow_reducer_binds_with_w_times_the_buffer():
    # W=4 at 10 Gbit/s, one reducer at 1 Gbit/s, 64 MiB: the reducer's link carries 4 x 64 MiB.
    net = Network.symmetric(4, 1, 10.0, 1.0)
    t = pool_model.allreduce(net, 16 * MiB, 4, plan_chunks, CHUNKING, FREE)
    assert t.chunks == 32  # 2 MiB chunks
    assert t.binds == "reducer link"
    assert t.transfer_s == pytest.approx(4 * wire(64 * MiB + 32 * (HEADER_SIZE + ZMTP_FRAMING), 32) / 125e6)
    assert t.transfer_s > 2.0  # 256 MiB at 125 MB/s


def test_reducer_cpu_binds_when_a_core_sums_slower_than_the_link():
    # one core at 1 CPU-s per GiB: 2 workers x 1 GiB take 2 s, the 100 Gbit/s links 0.09 s
    costs = Costs(
        reducer_cpu_s_per_gib=1.0, reducer_s_per_contribution=0.0, worker_s_per_chunk=0.0, worker_cpu_s_per_gib=0.0
    )
    net = Network.symmetric(2, 1, 100.0, 100.0)
    t = pool_model.allreduce(net, int(GIB) // 4, 4, plan_chunks, CHUNKING, costs)
    assert t.binds == "reducer CPU"
    assert t.limits["reducer CPU"] == pytest.approx(2.0)
    four_cores = Network.symmetric(2, 1, 100.0, 100.0, shards=4, reducer_cores=4)
    assert pool_model.allreduce(four_cores, int(GIB) // 4, 4, plan_chunks, CHUNKING, costs).limits["reducer CPU"] == (
        pytest.approx(0.5)
    )


def test_small_messages_are_latency_bound():
    # 1 MiB at W=2 R=1: 16 chunks of 64 KiB (the floor), a window of 4: 4 round trips of 10 ms,
    # while 1 MiB takes 8.8 ms over a 1 Gbit/s link.
    net = Network.symmetric(2, 1, 1.0, 1.0, rtt_ms=10.0)
    t = pool_model.allreduce(net, MiB // 4, 4, plan_chunks, CHUNKING, FREE)
    assert (t.chunks, t.chunk_bytes) == (16, 64 * 1024)
    assert t.binds == "latency"
    assert t.limits["latency"] == pytest.approx(0.040)
    assert t.lag_s > 0.010  # the first chunk's round trip on top


def test_a_token_bucket_hides_the_first_rounds_lag():
    net = Network.symmetric(2, 2, 0.2, 0.2)
    plain = pool_model.allreduce(net, MiB, 4, plan_chunks, CHUNKING, FREE)
    bursty = pool_model.allreduce(
        Network.symmetric(2, 2, 0.2, 0.2, burst_bytes=256 * 1024), MiB, 4, plan_chunks, CHUNKING, FREE
    )
    assert plain.lag_s > 0 and bursty.lag_s == 0.0
    assert bursty.transfer_s == plain.transfer_s


def test_the_ring_moves_2_w_minus_1_over_w_of_the_buffer_and_waits_2_w_minus_1_latencies():
    net = Network.symmetric(8, 1, 1.0, 1.0, rtt_ms=2.0)
    t = peer_model.ring(net, 16 * MiB)
    assert t.transfer_s == pytest.approx(wire(2 * 7 / 8 * 16 * MiB, 14) / 125e6)
    assert t.lag_s == pytest.approx(14 * 0.001)
    assert peer_model.ring(Network.symmetric(1, 1, 1.0, 1.0), MiB).seconds == 0.0


def test_the_pool_beats_the_ring_by_2_w_minus_1_over_w_less_its_lag_at_parity():
    # R = W = 8, 256 MiB: 256 chunks of 1 MiB; the lag is one round, W chunks over a reducer's
    # link: W x S / (R x depth) / B = S/B / 32, so 1.75 / (1 + 1/32)
    net = Network.symmetric(8, 8, 1.0, 1.0)
    pool = pool_model.allreduce(net, 64 * MiB, 4, plan_chunks, CHUNKING, FREE)
    ring = peer_model.ring(net, 256 * MiB)
    assert pool.lag_s / pool.transfer_s == pytest.approx(1 / 32, rel=0.01)
    assert ring.seconds / pool.seconds == pytest.approx(1.75 / (1 + 1 / 32), rel=0.01)


def test_the_tree_is_log_latency():
    net = Network.symmetric(64, 1, 100.0, 100.0, rtt_ms=1.0)
    assert peer_model.tree(net, 1024).lag_s == pytest.approx(6 * 0.001)
    assert peer_model.tree(net, 1024).seconds < peer_model.ring(net, 1024).seconds


def test_a_step_overlaps_buckets_with_backward_and_pays_the_pools_lag_once():
    shape = StepShape(compute_s=0.3, gradient_bytes=4.0, bucket_bytes=1.0, first_bucket_bytes=1.0, optimizer_s=0.01)
    assert shape.buckets() == [(1.0, 1), (1.0, 3)]

    def each(_: float) -> Timing:
        return Timing(0.1, 0.05, "worker link")

    # backward 0.2 s from 0.1 s: buckets ready at 0.15, 0.2, 0.25, 0.3; transfers back to back
    # from 0.15 end at 0.55, plus one lag 0.6, plus the optimizer
    assert BACKWARD_SHARE == pytest.approx(2 / 3)
    assert step_time(shape, each, pipelined=True) == pytest.approx(0.61)
    # one at a time (a ring): each takes 0.15 s from 0.15: 0.75, plus the optimizer
    assert step_time(shape, each, pipelined=False) == pytest.approx(0.76)


def test_buckets_in_a_row_end_as_one_at_a_time_would():
    shape = StepShape(compute_s=3.0, gradient_bytes=10.0, bucket_bytes=3.0, first_bucket_bytes=0.5)
    assert shape.buckets() == [(0.5, 1), (3.0, 3), (0.5, 1)]
    sizes = [0.5, 3.0, 3.0, 3.0, 0.5]

    def by_hand(transfer: float) -> float:
        free, made = 0.0, 0.0
        for size in sizes:
            made += size
            free = max(free, 1.0 + 2.0 * made / 10.0) + transfer * size
        return max(3.0, free)

    for transfer in (0.01, 0.2, 1.0):  # compute-bound, in between, link-bound

        def each(size: float, transfer: float = transfer) -> Timing:
            return Timing(transfer * size, 0.0, "worker link")

        assert step_time(shape, each, pipelined=True) == pytest.approx(by_hand(transfer))


def test_a_step_is_its_compute_when_the_all_reduces_cost_nothing_and_waits_for_the_last_otherwise():
    shape = StepShape(compute_s=1.0, gradient_bytes=1.0)
    assert step_time(shape, lambda _: Timing(0.0, 0.0, "nothing to send"), pipelined=True) == 1.0
    # the last bucket is ready only at the end of the backward pass
    assert step_time(shape, lambda _: Timing(0.001, 0.0, "worker link"), pipelined=True) == pytest.approx(1.001)
