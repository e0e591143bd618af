"""plan_chunks and reducer_of: the chunk plan every rank computes on its own."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reduction_server.client.chunking import MIN_SPLIT_BYTES, plan_chunks, reducer_of

ITEMSIZES = [1, 2, 4, 8]


def assert_exact_cover(plan, total):
    """Chunks in order, each non-empty, abutting, covering [0, total) exactly."""
    position = 0
    for offset, count in plan:
        assert offset == position, f"gap or overlap at {offset} (expected {position}) in {plan[:5]}..."
        assert count >= 1, f"empty chunk at {offset}"
        position += count
    assert position == total


@st.composite
def plans(draw):
    """(total, itemsize, R, chunk_bytes) with at most a few thousand chunks, so each example is quick."""
    itemsize = draw(st.sampled_from(ITEMSIZES))
    chunk_bytes = draw(st.one_of(st.integers(8, 4096), st.integers(4096, 1 << 24)))
    most = max(1, min(1 << 28, 4000 * chunk_bytes) // itemsize)
    total = draw(st.one_of(st.integers(1, 300), st.integers(1, most)))
    return total, itemsize, draw(st.integers(1, 16)), chunk_bytes


@settings(max_examples=300, deadline=None)
@given(plans())
def test_plan_covers_exactly_without_overlap(case):
    total, itemsize, num_reducers, chunk_bytes = case
    plan = plan_chunks(total, itemsize, num_reducers, chunk_bytes)
    assert_exact_cover(plan, total)
    for _, count in plan:
        assert count * itemsize <= chunk_bytes, f"chunk of {count} x {itemsize} B exceeds {chunk_bytes} B"
    # Every rank must derive the same plan from the same four numbers.
    assert plan == plan_chunks(total, itemsize, num_reducers, chunk_bytes)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("num_reducers", [1, 3])
def test_one_element(itemsize, num_reducers):
    assert plan_chunks(1, itemsize, num_reducers, 4 << 20) == [(0, 1)]
    assert plan_chunks(1, itemsize, num_reducers, 8) == [(0, 1)]


@pytest.mark.parametrize("total", [0, -1])
def test_empty_buffer_has_no_chunks(total):
    assert plan_chunks(total, 4, 2, 1 << 20) == []


@pytest.mark.parametrize(
    "total,itemsize,chunk_bytes",
    [
        (1_000_003, 4, 1 << 16),  # not a multiple of the chunk
        (16 * 1024 * 1024 + 3, 4, 4 << 20),  # the 64 MiB-and-a-tail case
        (12345, 2, 1000),  # chunk not a multiple of the alignment
        (777, 8, 64),
    ],
)
@pytest.mark.parametrize("num_reducers", [1, 2, 3, 8])
def test_sizes_not_a_multiple_of_the_chunk(total, itemsize, chunk_bytes, num_reducers):
    plan = plan_chunks(total, itemsize, num_reducers, chunk_bytes)
    assert_exact_cover(plan, total)
    assert max(count for _, count in plan) * itemsize <= chunk_bytes
    assert len(plan) >= -(-total * itemsize // chunk_bytes)


@pytest.mark.parametrize("num_reducers", [2, 3, 4, 8])
@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("fraction", [0.3, 1.0, 1.5])
def test_mid_size_buffers_use_every_reducer(num_reducers, itemsize, fraction):
    """A buffer over R x MIN_SPLIT_BYTES but under R chunks is spread over all R reducers."""
    chunk_bytes = 4 << 20
    nbytes = int(num_reducers * MIN_SPLIT_BYTES + fraction * (num_reducers - 1) * (chunk_bytes - MIN_SPLIT_BYTES))
    total = nbytes // itemsize + 1
    plan = plan_chunks(total, itemsize, num_reducers, chunk_bytes)
    assert_exact_cover(plan, total)
    assert len(plan) >= num_reducers
    for seq in range(num_reducers):
        used = {reducer_of(seq, k, num_reducers) for k in range(len(plan))}
        assert used == set(range(num_reducers))


def test_small_buffers_are_not_split_below_min_split():
    # 10 KiB of float32 over 4 reducers: one chunk, not four tiny ones.
    assert plan_chunks(2560, 4, 4, 4 << 20) == [(0, 2560)]
    # Just over one chunk of data is split into pieces of at least MIN_SPLIT_BYTES.
    plan = plan_chunks(3 * MIN_SPLIT_BYTES // 4, 4, 8, 1 << 20)
    assert all(count * 4 >= MIN_SPLIT_BYTES for _, count in plan[:-1])


def test_chunk_starts_are_aligned():
    for offset, _ in plan_chunks(10_000_019, 4, 3, 1 << 20):
        assert offset % 64 == 0


def test_reducer_of_rotates():
    for num_reducers in (1, 2, 3, 5):
        # Chunk k of collective seq goes to (seq + k) mod R ...
        assert [reducer_of(0, k, num_reducers) for k in range(2 * num_reducers)] == [
            k % num_reducers for k in range(2 * num_reducers)
        ]
        # ... so one-chunk collectives rotate over the reducers, seq by seq.
        assert [reducer_of(seq, 0, num_reducers) for seq in range(3 * num_reducers)] == [
            seq % num_reducers for seq in range(3 * num_reducers)
        ]
        for seq in range(10):
            assert sorted(reducer_of(seq, k, num_reducers) for k in range(num_reducers)) == list(range(num_reducers))


@pytest.mark.parametrize("num_reducers", [1, 2, 3, 8])
@pytest.mark.parametrize("depth", [None, 1, 3, 16, 32])
def test_each_reducer_gets_pipeline_depth_chunks(num_reducers, depth):
    """Upload and download of a collective overlap only if each reducer has several chunks."""
    from collections import Counter

    from reduction_server.client.chunking import reducer_of
    from reduction_server.config.settings import DEFAULT_PIPELINE_DEPTH

    total = (16 << 20) // 4
    plan = plan_chunks(total, 4, num_reducers, 4 << 20, *([depth] if depth else []))
    assert_exact_cover(plan, total)
    per_reducer = Counter(reducer_of(0, k, num_reducers) for k in range(len(plan)))
    assert len(per_reducer) == num_reducers
    wanted = depth or DEFAULT_PIPELINE_DEPTH
    # as deep as asked, unless that would cut below MIN_SPLIT_BYTES
    assert min(per_reducer.values()) >= min(wanted, (16 << 20) // (num_reducers * MIN_SPLIT_BYTES))
    # and no deeper than the 4 MiB chunk limit or the alignment makes it
    assert max(per_reducer.values()) <= max(wanted + 1, -(-4 // num_reducers) + 1)
