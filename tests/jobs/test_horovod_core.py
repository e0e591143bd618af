"""The Horovod-style negotiation (client/horovod/coordinator.py) with real reducers and one
Coordinator per rank (threads of this process): matching by name, fusion, and every way a named
collective can fail."""

import itertools
import random
import threading
import time

import numpy as np
import pytest

from helpers.cluster import TOKEN, reducers, run_ranks
from reduction_server.client import Communicator
from reduction_server.client.buffers import wire_view
from reduction_server.client.horovod.coordinator import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    Coordinator,
    Request,
    cycle_time,
    gather_bytes,
)
from reduction_server.errors import CollectiveError, ConfigError
from reduction_server.wire.protocol import ReduceOp


def submit(coord, name, array, kind=ALLREDUCE, op=ReduceOp.SUM, root=0, out=True):
    wire = wire_view(array)
    request = Request(name, kind, wire.dtype, array.shape, op, root)
    return coord.submit(request, wire, wire_view(array, writable=True) if out else None)


class Recording(Communicator):
    """A Communicator that records the float32 collectives it starts (the data, not the
    negotiation's integer tables)."""

    def _start(self, src, dst, op, root, result, **options):
        if dst.dtype.name == "FLOAT32":
            self.data_collectives.append(dst.count)
        return super()._start(src, dst, op, root, result, **options)


_generations = itertools.count(1)  # each test a new generation of the job: the reducers forget the last


def coordinators(group, world, **options):
    generation = next(_generations)

    def make(rank):
        comm = Recording(group.addresses, rank, world, job_token=TOKEN, generation=generation)
        comm.data_collectives = []
        return Coordinator(comm, **options)

    return make


def run(world, group, body, **options):
    return run_ranks(world, coordinators(group, world, **options), body, limit=30)


def test_tensors_submitted_in_any_order_are_matched_by_name_and_fused(group):
    names = [f"grad{i}" for i in range(10)]

    def body(coord, rank):
        arrays = {n: np.full(64, rank + 1.0 + i, np.float32) for i, n in enumerate(names)}
        order = names[:]
        random.Random(rank).shuffle(order)
        futures = {n: submit(coord, n, arrays[n]) for n in order}  # within one cycle (0.3 s)
        for n in names:
            assert futures[n].result(10) is None
        return {n: arrays[n][0] for n in names}, list(coord.comm.data_collectives)

    results = run(3, group, body, cycle_seconds=0.3, threshold=1024)
    for values, collectives in results:
        assert values == {f"grad{i}": 6.0 + 3 * i for i in range(10)}
        # 256-byte tensors, 1 KiB threshold: 4 + 4 + 2 tensors of 64 elements.
        assert collectives == [256, 256, 128], collectives


def test_threshold_zero_turns_fusion_off(group):
    def body(coord, rank):
        futures = [submit(coord, f"t{i}", np.ones(8, np.float32)) for i in range(3)]
        for f in futures:
            f.result(10)
        return list(coord.comm.data_collectives)

    assert run(2, group, body, cycle_seconds=0.3, threshold=0) == [[8, 8, 8]] * 2


def test_broadcast_allgather_and_mixed_kinds(group):
    def body(coord, rank):
        b = np.full(5, rank, np.int32)
        g = np.arange(rank + 2, dtype=np.float64)
        fb = submit(coord, "b", b, BROADCAST, root=2)
        fg = submit(coord, "g", g, ALLGATHER, out=False)
        s = np.ones(3, np.float32)
        fs = submit(coord, "s", s)
        fs.result(10)
        return fb.result(10), b.tolist(), fg.result(10).tolist(), s.tolist()

    results = run(3, group, body)
    gathered = [float(v) for r in range(3) for v in range(r + 2)]
    assert results == [(None, [2] * 5, gathered, [3.0] * 3)] * 3


def test_disagreements_fail_that_name_on_every_rank_and_nothing_else(group):
    def body(coord, rank):
        cases = {
            "shape": (np.zeros(rank + 1, np.float32), ALLREDUCE, ReduceOp.SUM, 0),
            "dtype": (np.zeros(2, np.float32 if rank else np.float64), ALLREDUCE, ReduceOp.SUM, 0),
            "op": (np.zeros(2, np.float32), ALLREDUCE, ReduceOp.MAX if rank else ReduceOp.SUM, 0),
            "kind": (np.zeros(2, np.float32), BROADCAST if rank else ALLREDUCE, ReduceOp.SUM, 0),
            "root": (np.zeros(2, np.float32), BROADCAST, ReduceOp.SUM, rank),
        }
        futures = {n: submit(coord, n, a, kind, op, root) for n, (a, kind, op, root) in cases.items()}
        good = np.ones(2, np.float32)
        fine = submit(coord, "fine", good)
        errors = {}
        for n, f in futures.items():
            with pytest.raises(CollectiveError) as info:
                f.result(10)
            errors[n] = str(info.value)
        fine.result(10)
        return errors, good.tolist()

    results = run(2, group, body)
    for rank, (errors, good) in enumerate(results):
        assert good == [2.0, 2.0]
        prefix = f"rank {rank}: tensor "
        assert errors == {
            "shape": prefix + "'shape': ranks disagree on its shape: ranks [0]: [1]; ranks [1]: [2]",
            "dtype": prefix + "'dtype': ranks disagree on its dtype: ranks [0]: float64; ranks [1]: float32",
            "op": prefix + "'op': ranks disagree on its op: ranks [0]: sum; ranks [1]: max",
            "kind": prefix + "'kind': ranks disagree on its kind: ranks [0]: allreduce; ranks [1]: broadcast",
            "root": prefix + "'root': ranks disagree on its root: ranks [0]: 0; ranks [1]: 1",
        }


def test_a_name_only_some_ranks_submit_fails_naming_them(group):
    failed = threading.Event()  # rank 1 goes on once rank 0 has seen 'lonely' fail

    def body(coord, rank):
        lonely = submit(coord, "lonely", np.ones(4, np.float32)) if rank == 0 else None
        if lonely is not None:
            with pytest.raises(CollectiveError) as info:
                lonely.result(10)
            message = str(info.value)
            failed.set()
        else:
            assert failed.wait(10)
            message = None
        after = np.ones(1, np.float32)
        submit(coord, "after", after).result(10)  # the job goes on
        return message, after[0]

    (message, after0), (_, after1) = run(2, group, body, stall_timeout=0.5)
    assert (
        "tensor 'lonely' (allreduce of [4] float32 op sum) was submitted by ranks [0] but not by "
        "ranks [1] within 0.5 s" in message
    )
    assert after0 == after1 == 2.0


def test_shutdown_of_one_rank_fails_what_the_others_wait_for(group):
    def body(coord, rank):
        if rank == 0:
            time.sleep(0.3)
            coord.shutdown(10)
            with pytest.raises(CollectiveError, match=r"'late' cannot run: ranks \[0\] have shut down"):
                submit(coord, "late", np.ones(1, np.float32))
            return None
        waiting = submit(coord, "never", np.ones(1, np.float32))
        with pytest.raises(CollectiveError) as info:
            waiting.result(10)
        return str(info.value)

    _, message = run(2, group, body)
    assert message == "rank 1: ranks [0] shut down before this collective completed"


def test_a_rank_that_vanishes_fails_the_others_within_the_liveness_timeout(group):
    # Both admitted first: a rank lost mid-job. One gone before the others come:
    # test_communicator_lifetime.
    both = threading.Barrier(2)

    def body(coord, rank):
        both.wait(20)
        if rank == 1:
            coord.comm._engine.close()  # gone, as if its process died: no negotiation, no goodbye
            return None
        waiting = submit(coord, "orphan", np.ones(1, np.float32))
        with pytest.raises(CollectiveError) as info:
            waiting.result(20)
        with pytest.raises(CollectiveError, match="an earlier collective failed"):
            submit(coord, "next", np.ones(1, np.float32))
        return str(info.value)

    message, _ = run(2, group, body)
    assert "rank 1 (host" in message and "was lost" in message, message


def test_duplicate_names_in_flight_are_refused():
    with reducers(1, token=TOKEN) as g:

        def body(coord, rank):
            first = submit(coord, "twice", np.ones(2, np.float32))
            with pytest.raises(ValueError, match="'twice' is already in flight"):
                submit(coord, "twice", np.ones(2, np.float32))
            first.result(10)
            again = np.ones(2, np.float32)
            submit(coord, "twice", again).result(10)  # reusable once finished
            return again.tolist()

        assert run(2, g, body) == [[2.0, 2.0]] * 2


def test_gather_bytes_exact_for_every_rank(group):
    def body(comm, rank):
        return gather_bytes(comm, bytes([rank + 1]) * (rank * 3))

    expected = [bytes([r + 1]) * (r * 3) for r in range(3)]
    generation = next(_generations)
    results = run_ranks(3, lambda r: Communicator(group.addresses, r, 3, job_token=TOKEN, generation=generation), body)
    assert results == [expected] * 3


def test_cycle_time_from_the_environment():
    assert cycle_time({}) == 0.001
    assert cycle_time({"HOROVOD_CYCLE_TIME": "5"}) == 0.005
    assert cycle_time({"HOROVOD_CYCLE_TIME": "5", "RS_CYCLE_TIME": "0.5"}) == 0.0005
    with pytest.raises(ConfigError, match="HOROVOD_CYCLE_TIME='fast'"):
        cycle_time({"HOROVOD_CYCLE_TIME": "fast"})


def test_timeline_shows_tensors_not_negotiation(group, tmp_path, monkeypatch):
    """RS_TIMELINE: each fused collective is one event named after its tensors, with how long
    negotiation took; the negotiation's own collectives (every cycle) stay off it."""
    import json

    monkeypatch.setenv("RS_TIMELINE", str(tmp_path / "trace.json"))

    def body(coord, rank):
        futures = [submit(coord, f"w{i}", np.ones(4, np.float32)) for i in range(5)]
        for f in futures:
            f.result(10)
        time.sleep(0.05)  # idle cycles, which must not show

    run(2, group, body, cycle_seconds=0.2)
    for rank in range(2):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        collectives = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("tensors")]
        # Usually one fused event ("allreduce.w0, allreduce.w1, allreduce.w2 +2": Horovod's names);
        # a loaded machine may split the submissions over two cycles.
        assert [t for e in collectives for t in e["args"]["tensors"]] == [f"allreduce.w{i}" for i in range(5)], events
        for e in collectives:
            shown = ", ".join(e["args"]["tensors"][:3])
            assert e["name"].startswith(shown), e
            assert e["args"]["negotiation_us"] > 0
            # Horovod's NEGOTIATE_ALLREDUCE: from the first tensor's submission until agreed, on the same row
            negotiated = [
                n
                for n in events
                if n.get("name") == "NEGOTIATE_ALLREDUCE" and n["tid"] == e["tid"] and n["ts"] + n["dur"] <= e["ts"] + 1
            ]
            assert negotiated and negotiated[-1]["dur"] > 0, events
        assert not [e for e in events if e.get("name", "").startswith("all_reduce")], "negotiation was traced"


def test_adasum_is_refused_as_a_setting_and_as_horovod_refuses_what_it_cannot_run():
    """hvd.Adasum is refused by name: a ConfigError, and the NotImplementedError Horovod raises
    where it cannot run Adasum (sparse tensors), which Horovod's own tests expect."""
    from reduction_server.client.horovod.ops import Adasum, resolve_op

    with pytest.raises(ConfigError, match="Adasum is not supported") as caught:
        resolve_op(Adasum)
    assert isinstance(caught.value, NotImplementedError)
