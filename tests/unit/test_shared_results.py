"""Result slots that several ranks on one host read (reduction_server/reducer/shared_results.py,
client/engine/slots.py): a slot is written again only once every rank handed it has released that
use of it; a worker maps them read-only and says so in its own segment; it releases a result
once read, or once failover keeps it no longer, even after its connection was replaced; a result
kept from a lost reducer is copied out of the slot and released."""

from __future__ import annotations

import numpy as np
import pytest

from reduction_server.client.chunking import Chunk
from reduction_server.client.engine.collective import Collective
from reduction_server.client.engine.identity import Identity
from reduction_server.client.engine.kept import KeptResults
from reduction_server.client.engine.slots import ResultLease, Slots
from reduction_server.reducer.shared_results import SHARED_RESULT_BYTES, SharedResults
from reduction_server.wire import protocol, shared_memory
from reduction_server.wire.protocol import DType, ReduceOp

BIG = SHARED_RESULT_BYTES


@pytest.fixture
def results():
    res = SharedResults(1 << 20, slots=2)
    yield res
    res.close()


def _rank_segment():
    return shared_memory.Segment.create(2, 4096)


def _handed(results, readers, nbytes=BIG):
    """Take a result slot for `readers` ({rank: segment}) and hand it to each: (slot, use)."""
    slot, view, ranks = results.take(nbytes, readers)
    assert ranks == frozenset(readers) and len(view) == nbytes
    for rank in sorted(ranks):
        results.hand(slot, rank, readers[rank])
    return protocol.shared_result_slot(results.aux(slot))


def test_a_slot_is_free_again_only_once_every_rank_handed_it_released_that_use(results):
    a, b = _rank_segment(), _rank_segment()
    slot, use = _handed(results, {0: a, 1: b})
    assert use == 1
    other, _, _ = results.take(BIG, {0: a, 1: b})  # taken, handed to nobody (its round failed)...
    assert other != slot and results.take(BIG, {0: a, 1: b})[0] == other  # ...so free again at the next take
    a.release(slot, 1)
    b.release(slot, 2)  # a use it was not handed
    assert results.take(BIG, {0: a, 1: b})[0] == other and results.held() == 1
    b.release(slot, 1)
    assert results.held() == 0
    used = dict(_handed(results, {0: a, 1: b}) for _ in range(2))
    assert used[slot] == 2 and results.take(BIG, {0: a, 1: b}) is None  # its second use; both handed now


def test_results_too_small_or_too_large_or_for_one_reader_get_no_slot(results):
    a, b = _rank_segment(), _rank_segment()
    assert results.take(BIG - 1, {0: a, 1: b}) is None
    assert results.take((1 << 20) + 1, {0: a, 1: b}) is None
    assert results.take(BIG, {0: a}) is None
    assert results.held() == 0


def test_a_rank_whose_release_already_says_the_next_use_does_not_read_it(results):
    """Use numbers come round again: a rank whose counter equals the use the slot is taken for
    would count as released before it read; it gets its result in its own slot instead."""
    a, b, c = _rank_segment(), _rank_segment(), _rank_segment()
    slot = results.take(BIG, {0: a, 1: b})[0]  # not handed: free again, its next use is 2
    c.release(slot, 2)
    again, _, ranks = results.take(BIG, {0: a, 1: b, 2: c})
    assert again == slot and ranks == {0, 1}
    a.release(slot, 3)
    assert results.take(BIG, {0: a, 2: c}) is None  # one reader left: no slot


def test_a_rank_admitted_again_holds_nothing_of_its_old_connection(results):
    a, b = _rank_segment(), _rank_segment()
    slot, use = _handed(results, {0: a, 1: b})
    a.release(slot, use)
    assert results.held() == 1  # rank 1 was told, and then lost its connection before reading it
    results.forget(1)
    assert results.held() == 0


def test_a_new_job_gets_a_new_segment_only_when_a_slot_is_still_held(results):
    first = results.offer
    results.renew()
    assert results.offer is first  # nothing held: kept
    _handed(results, {0: _rank_segment(), 1: _rank_segment()})  # ranks that never release (their processes died)
    results.renew()
    assert results.offer["nonce"] != first["nonce"] and results.held() == 0
    assert results.take(BIG, {0: _rank_segment(), 1: _rank_segment()}) is not None


def _worker(results_offer):
    slots = Slots(Identity(rank=0, world=2, job=0, generation=0), [True], window=2, slot_bytes=4096)
    slots.offer(0)
    slots.welcomed(0, {"shared_memory": True, "shared_results": results_offer})
    return slots


@pytest.fixture
def worker(results):
    slots = _worker(results.offer)
    yield slots
    slots.close()


def _written(results, segment, data: bytes):
    """A result slot with data in it, handed to rank 0 (whose segment this is) and another rank:
    (slot, the aux rank 0 is told)."""
    slot, view, _ = results.take(len(data), {0: segment, 1: _rank_segment()})
    view[:] = data
    results.hand(slot, 0, segment)
    return slot, results.aux(slot)


def test_a_worker_maps_result_slots_read_only_and_says_so(results, worker):
    assert worker.results[0] is not None and worker.segments[0].accepts_results()
    with pytest.raises(TypeError):
        worker.results[0].slot(0, 8)[:] = bytes(8)
    refused = _worker({**results.offer, "nonce": "00" * 16})
    try:  # an offer that does not check out: not mapped, and the reducer is not told it is
        assert refused.results[0] is None and not refused.segments[0].accepts_results()
    finally:
        refused.close()


def test_a_result_is_released_once_read_or_once_its_lease_ends_even_after_a_new_connection(results, worker):
    mine = worker.segments[0]
    slot, aux = _written(results, mine, b"\x07" * BIG)
    dest = bytearray(BIG)
    assert worker.read_result(0, aux, memoryview(dest), keep=False) is None
    assert dest == b"\x07" * BIG and mine.released(slot) == 1 and worker.results_read == 1
    assert results.held() == 0

    slot, aux = _written(results, mine, b"\x09" * BIG)
    lease = worker.read_result(0, aux, memoryview(bytearray(BIG)), keep=True)
    assert isinstance(lease, ResultLease) and results.held() == 1
    worker.offer(0)  # a new connection, a new segment: the lease releases into the one it came through
    worker.welcomed(0, {"shared_memory": True, "shared_results": results.offer})
    assert bytes(lease.view) == b"\x09" * BIG
    lease.end()
    assert mine.released(slot) == protocol.shared_result_slot(aux)[1] and results.held() == 0
    with pytest.raises(ValueError, match="out of range"):
        worker.read_result(0, protocol.shared_result_aux(5, 1), memoryview(bytearray(8)), keep=False)


def test_a_result_kept_from_a_lost_reducer_is_copied_out_of_its_slot_and_released(results, worker):
    n = BIG // 4
    _, aux = _written(results, worker.segments[0], np.full(n, 3.0, np.float32).tobytes())
    recv = memoryview(bytearray(BIG))
    coll = Collective(
        seq=0,
        dtype=DType.FLOAT32,
        op=ReduceOp.SUM,
        root=0,
        send=None,
        recv=recv,
        total=n,
        chunks=[Chunk(0, n, 0)],
        result=None,
    )
    kept = KeptResults(window=2, num_endpoints=2)
    kept.keep(coll, 0, 0, worker.read_result(0, aux, recv, keep=True), depth=2)
    assert results.held() == 1
    (item,) = kept.take(0)
    assert isinstance(item.data, bytearray) and item.lease is None
    assert (np.frombuffer(item.data, np.float32, n) == 3.0).all()
    assert results.held() == 0


def test_the_counters_are_checked_before_they_are_touched():
    from reduction_server import _native

    buf = bytearray(64)
    _native.store_release(buf, 8, 2**64 - 1)
    assert _native.load_acquire(buf, 8) == 2**64 - 1 and _native.load_acquire(bytes(16), 8) == 0
    for offset in (-8, 4, 64):
        with pytest.raises(ValueError, match=f"counter at byte {offset} .* out of range or not 8-byte aligned"):
            _native.store_release(buf, offset, 1)
    with pytest.raises((TypeError, BufferError, ValueError), match="writable|read-only"):
        _native.store_release(bytes(16), 0, 1)
