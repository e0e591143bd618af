"""`bench sizing`'s grid (bench/sizing.py) spans what issue 42 asks, and each point is predicted
from the model alone (nothing measured yet)."""

from __future__ import annotations

import pytest

from reduction_server.bench import sizing


def test_the_grid_spans_the_issues_axes():
    points = sizing.grid()
    flat = [p for p in points if p.rtt_ms == 0]
    assert len(flat) >= 40 and len(points) - len(flat) >= 6
    assert {p.workers for p in points} <= set(range(2, 13)) and {p.reducers for p in points} <= set(range(1, 9))
    assert min(p.workers for p in points) == 2 and max(p.workers for p in points) == 12
    assert any(p.reducer_mbit < p.worker_mbit for p in points) and any(p.reducer_mbit > p.worker_mbit for p in points)
    assert all(100 <= rate <= 1000 for p in points for rate in (p.worker_mbit, p.reducer_mbit))
    assert {p.dtype for p in points} == {"float32", "float16"}
    assert {p.mib for p in points} == {1.0, 4.0, 16.0, 64.0}
    assert {p.rtt_ms for p in points} - {0.0} <= {2.0, 5.0, 10.0}
    assert points == sizing.grid()  # seeded: the same grid every run


def test_a_point_is_predicted_with_the_emulations_facts():
    point = sizing.Point(4, 2, 200.0, 400.0, 4.0, 16.0, "float16")
    net = sizing.network(point, sizing.Shared(2.0, 3.0, 1e-4, 3.0))
    assert (net.workers, net.reducers, net.worker_up, net.reducer_down) == (4, 2, 25e6, 50e6)
    assert net.rtt_s == 0.004 and net.burst_bytes == 256 * 1024 and net.shared_cores == 2.0
    pool, ring = sizing.predict(point, None)
    assert pool.binds == "worker link" and pool.seconds > 16 * 2**20 / 25e6
    assert ring.seconds > 2 * 3 / 4 * 16 * 2**20 / 25e6


def test_the_grid_in_parts_covers_every_point_once_with_its_index():
    points = sizing.grid()
    for n in (1, 2, 3, 7):
        parts = [sizing.part_of(points, f"{k}/{n}") for k in range(1, n + 1)]
        assert [i for part in parts for i, _ in part] == list(range(len(points)))
        assert [p for part in parts for _, p in part] == points
        assert max(map(len, parts)) - min(map(len, parts)) <= 1  # near-equal calls
    for bad in ("0/2", "3/2", "1", "a/b", f"1/{len(points) + 1}"):
        with pytest.raises(ValueError, match=f"--part '{bad}': expected K/N"):
            sizing.part_of(points, bad)
