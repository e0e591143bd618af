"""One rank: plain torch.distributed collectives through init_process_group("reduction_server")
(no MASTER_ADDR: the discovery-only rendezvous). Checks every result against what each rank's
known inputs give and prints {"rank", "done", "failures"} as one JSON line."""

import os
import time

import torch
import torch.distributed as dist
from report import report  # noqa: E402
from torch_model import DEVICE  # noqa: E402  (RS_TEST_DEVICE: "cuda" in the tests' GPU runs)

import reduction_server.client.torch  # noqa: F401  (registers the backend)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
]
OPS = {
    "SUM": dist.ReduceOp.SUM,
    "AVG": dist.ReduceOp.AVG,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
}


def value(rank, dtype, n=37):
    """Small values (exact in every dtype) that differ by rank and position."""
    base = torch.arange(n, dtype=torch.float64) % 5 + 1 + rank
    if dtype.is_floating_point:
        base = base * 0.5  # exact in float16 and bfloat16 too
    return base.to(dtype)


def expected(op, dtype, world):
    xs = torch.stack([value(r, torch.float64 if dtype.is_floating_point else torch.int64) for r in range(world)])
    if op == "SUM":
        out = xs.sum(0)
    elif op == "AVG":
        out = xs.sum(0) / world
        if not dtype.is_floating_point:
            out = torch.trunc(out)
    elif op == "PRODUCT":
        out = xs.prod(0)
    elif op == "MIN":
        out = xs.min(0).values
    else:
        out = xs.max(0).values
    return out.to(dtype)  # integer overflow wraps, as the reducers' does


def main():
    """Every check, on tensors made on RS_TEST_DEVICE."""
    with torch.device(DEVICE):
        return _checks()


def _checks():
    os.environ.pop("MASTER_ADDR", None)
    os.environ.pop("MASTER_PORT", None)
    dist.init_process_group("reduction_server")
    rank, world = dist.get_rank(), dist.get_world_size()
    failures, done = [], 0

    def check(name, got, want):
        nonlocal done
        done += 1
        if got.dtype != want.dtype or not torch.equal(got, want):
            failures.append(f"{name}: got {got[:6].tolist()} want {want[:6].tolist()}")

    # Every op on several dtypes, synchronous and async.
    pending = []
    for dtype in DTYPES:
        for name, op in OPS.items():
            t = value(rank, dtype)
            if (dtype, name) in {(torch.float32, "SUM"), (torch.int64, "MAX")}:
                work = dist.all_reduce(t, op=op, async_op=True)
                pending.append((f"async {dtype} {name}", t, expected(name, dtype, world), work))
            else:
                dist.all_reduce(t, op=op)
                check(f"all_reduce {dtype} {name}", t, expected(name, dtype, world))
    for name, t, want, work in pending:
        work.wait()
        check(name, t, want)
    # Non-contiguous tensor, and a 0-d tensor.
    t = torch.stack([value(rank, torch.float32, 8)] * 2, 1)[:, 1]
    assert not t.is_contiguous()
    dist.all_reduce(t)
    check("non-contiguous", t, expected("SUM", torch.float32, world)[:8])
    s = torch.tensor(float(rank + 1))
    dist.all_reduce(s, op=dist.ReduceOp.MAX)
    check("0-d", s, torch.tensor(float(world)))
    # complex SUM and bool MAX (or) / MIN (and).
    c = torch.tensor([1 + 2j, rank * 1j], dtype=torch.complex64)
    dist.all_reduce(c)
    check("complex", c, torch.tensor([world * (1 + 2j), sum(range(world)) * 1j], dtype=torch.complex64))
    b = torch.tensor([rank == 0, True, False])
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    check("bool max", b, torch.tensor([True, True, False]))
    b = torch.tensor([rank == 0, True, False])
    dist.all_reduce(b, op=dist.ReduceOp.MIN)
    check("bool min", b, torch.tensor([world == 1, True, False]))
    # Unsupported ops and dtypes: clear errors, raised before anything is sent.
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=op)
            failures.append(f"{op} did not raise")
        except (ValueError, RuntimeError) as exc:
            if "does not support" not in str(exc):
                failures.append(f"{op}: unclear error {exc}")
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int16))
        failures.append("int16 all_reduce did not raise")
    except (TypeError, RuntimeError) as exc:
        if "cannot reduce" not in str(exc):
            failures.append(f"int16: unclear error {exc}")
    try:
        dist.all_reduce(torch.ones(2, device="meta"))
        failures.append("meta tensor did not raise")
    except (TypeError, RuntimeError) as exc:
        if "cpu and cuda" not in str(exc):
            failures.append(f"meta: unclear error {exc}")
    # broadcast from every root, several dtypes (int16 and bool go as bytes).
    for root in range(world):
        for dtype in (torch.float32, torch.int16, torch.bool, torch.bfloat16):

            def pattern(k, dtype=dtype):
                x = torch.arange(11) * (k + 1)
                return (x % 2 if dtype == torch.bool else x).to(dtype)

            t = pattern(rank)
            dist.broadcast(t, src=root)
            check(f"broadcast {dtype} root {root}", t, pattern(root))
    # all_gather: every rank's tensor in rank order; also a 2-d and an int64 one.
    for dtype, shape in ((torch.float32, (5,)), (torch.int64, (2, 3)), (torch.float16, (4,))):
        mine = (torch.arange(torch.Size(shape).numel()).reshape(shape) + 100 * rank).to(dtype)
        outs = [torch.full(shape, -1).to(dtype) for _ in range(world)]
        dist.all_gather(outs, mine)
        for r in range(world):
            check(
                f"all_gather {dtype} slot {r}",
                outs[r],
                (torch.arange(torch.Size(shape).numel()).reshape(shape) + 100 * r).to(dtype),
            )
    work = dist.barrier(async_op=True)
    work.wait()
    dist.barrier()
    done += 1
    # all_gather_object goes through allgather of bytes.
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    check("all_gather_object", torch.tensor([o["rank"] for o in objs]), torch.arange(world))
    # A second group over all ranks shares the Communicator's order.
    whole = dist.new_group(list(range(world)))
    t = torch.ones(3)
    dist.all_reduce(t, group=whole)
    check("new_group all ranks", t, torch.full((3,), float(world)))
    subgroups(rank, world, check)
    t = torch.ones(3)
    dist.all_reduce(t)
    check("default group after new_group", t, torch.full((3,), float(world)))
    n = 3 if rank == 0 else 4  # the ranks disagree on a size: the reducers fail it on every rank
    for name, call in (
        ("all_reduce", lambda: dist.all_reduce(torch.ones(n))),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.ones(n * world), torch.ones(n))),
    ):
        try:
            call()
            failures.append(f"an {name} the reducers failed returned")
        except RuntimeError as exc:
            if "disagree" not in str(exc):
                failures.append(f"a failed {name} raised without the reducers' words: {exc}")
    relays_and_reductions(rank, world, check)
    point_to_point(rank, world, check)
    another_default_device(rank, world, check)
    if DEVICE.type == "cuda":
        stream_order(rank, world, check)
    backend = dist.get_backend()
    dist.destroy_process_group()
    return {"rank": rank, "done": done, "failures": failures[:20], "backend": backend}


def relays_and_reductions(rank, world, check):
    """The collectives composed of all-reduces and relays, against exact values."""

    def mine(r, n=6, dtype=torch.float32):  # rank r's input: distinct in every rank and position
        return (torch.arange(n) + 10 * r + 1).to(dtype)

    total = sum(mine(r) for r in range(world))
    for root in range(world):  # reduce: the root gets the sum, the others keep their input
        t = mine(rank)
        dist.reduce(t, dst=root)
        check(f"reduce root {root}", t, total if rank == root else mine(rank))
    t = mine(rank)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    check("premul_sum 0.5", t, total * 0.5)
    # reduce_scatter: piece r of every rank's input, summed, to rank r (list and tensor forms).
    ins = [mine(rank, 4) * (r + 1) for r in range(world)]
    out = torch.zeros(4)
    dist.reduce_scatter(out, ins)
    check("reduce_scatter", out, sum(mine(j, 4) for j in range(world)) * (rank + 1))
    flat = torch.cat([mine(rank, 3) * (r + 1) for r in range(world)])
    out = torch.zeros(3)
    dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.MAX)
    check("reduce_scatter_tensor max", out, mine(world - 1, 3) * (rank + 1))
    assert torch.equal(flat, torch.cat([mine(rank, 3) * (r + 1) for r in range(world)])), "the input changed"
    # all_gather_into_tensor: every rank's input in rank order, 1-d and stacked.
    out = torch.zeros(world * 5, dtype=torch.int64)
    dist.all_gather_into_tensor(out, mine(rank, 5, torch.int64))
    check("all_gather_into_tensor", out, torch.cat([mine(r, 5, torch.int64) for r in range(world)]))
    out = torch.zeros(world, 2, 3)
    dist.all_gather_into_tensor(out, mine(rank).reshape(2, 3))
    check("all_gather_into_tensor stacked", out, torch.stack([mine(r).reshape(2, 3) for r in range(world)]))
    # gather and scatter from every root.
    for root in range(world):
        outs = [torch.zeros(6) for _ in range(world)] if rank == root else None
        dist.gather(mine(rank), outs, dst=root)
        if rank == root:
            check(f"gather root {root}", torch.stack(outs), torch.stack([mine(r) for r in range(world)]))
        out = torch.zeros(6)
        dist.scatter(out, [mine(r) * 7 for r in range(world)] if rank == root else None, src=root)
        check(f"scatter root {root}", out, mine(rank) * 7)
    # all_to_all with pieces of different sizes: rank j sends rank r (j + r + 1) elements.
    ins = [torch.full((rank + r + 1,), float(100 * rank + r)) for r in range(world)]
    outs = [torch.zeros(j + rank + 1) for j in range(world)]
    dist.all_to_all(outs, ins)
    check(
        "all_to_all",
        torch.cat(outs),
        torch.cat([torch.full((j + rank + 1,), float(100 * j + rank)) for j in range(world)]),
    )
    x = torch.arange(world * 2, dtype=torch.float64).reshape(world, 2) + 10 * rank  # row r to rank r
    out = torch.zeros(world, 2, dtype=torch.float64)
    dist.all_to_all_single(out, x)
    check(
        "all_to_all_single",
        out,
        torch.stack([torch.tensor([2 * rank, 2 * rank + 1], dtype=torch.float64) + 10 * j for j in range(world)]),
    )
    sizes_in = [r + 1 for r in range(world)]  # rank j sends r + 1 rows to rank r
    x = torch.cat([torch.full((r + 1, 2), float(10 * rank + r)) for r in range(world)])
    out = torch.zeros((rank + 1) * world, 2)
    dist.all_to_all_single(out, x, [rank + 1] * world, sizes_in)
    check(
        "all_to_all_single uneven",
        out,
        torch.cat([torch.full((rank + 1, 2), float(10 * j + rank)) for j in range(world)]),
    )
    # sparse all_reduce: the coalesced sum of every rank's entries.
    idx = torch.tensor([[rank, world], [0, 1]])
    sparse = torch.sparse_coo_tensor(idx, torch.tensor([1.0, 2.0]), (world + 1, 2))
    dist.all_reduce(sparse)
    want = torch.zeros(world + 1, 2)
    for r in range(world):
        want[r, 0] += 1.0
        want[world, 1] += 2.0
    check("sparse all_reduce", sparse.to_dense(), want)


def point_to_point(rank, world, check):
    """send/recv, isend/irecv and batch_isend_irecv, relayed by the reducers within each pair."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out = torch.zeros(5)
    works = [dist.isend(torch.full((5,), float(rank)), nxt), dist.irecv(out, prv)]
    for work in works:
        work.wait()
    check("isend/irecv ring", out, torch.full((5,), float(prv)))
    if world > 1 and rank in (0, world - 1):  # tags keep two messages of one pair apart
        other = world - 1 - rank
        first, second = torch.zeros(4), torch.zeros(4)
        if rank == 0:  # sends wait for their receives (as NCCL's): two in flight, received in reverse
            works = [
                dist.isend(torch.arange(4.0), dst=other, tag=7),
                dist.isend(torch.arange(4.0) * 3, dst=other, tag=8),
            ]
            for work in works:
                work.wait()
            dist.recv(first, src=other)
            check("send/recv back", first, torch.arange(4.0) * 2)
        else:
            dist.recv(second, src=other, tag=8)
            dist.recv(first, src=other, tag=7)
            check("recv tag 7", first, torch.arange(4.0))
            check("recv tag 8", second, torch.arange(4.0) * 3)
            dist.send(first * 2, dst=other)
    buf = torch.zeros(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, torch.full((3,), rank, dtype=torch.int64), nxt), dist.P2POp(dist.irecv, buf, prv)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    check("batch_isend_irecv", buf, torch.full((3,), prv, dtype=torch.int64))
    big = torch.zeros(1 << 20)  # many chunks, receive posted first: each pair's group has its own window
    for work in dist.batch_isend_irecv(
        [dist.P2POp(dist.irecv, big, prv), dist.P2POp(dist.isend, torch.full((1 << 20,), float(rank)), nxt)]
    ):
        work.wait()
    check("batch_isend_irecv, receive first, 4 MiB", big[::4096], torch.full((256,), float(prv)))


def subgroups(rank, world, check):
    """Groups of fewer ranks, served by the same reducers beside the default group."""
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1]) if world > 1 else None
    mine = evens if rank % 2 == 0 else odds
    members = [r for r in range(world) if r % 2 == rank % 2]
    t = torch.tensor([rank + 1.0, 1.0])
    dist.all_reduce(t, group=mine)
    check("subgroup all_reduce", t, torch.tensor([sum(r + 1.0 for r in members), float(len(members))]))
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=members[-1], group=mine)  # src is a job rank
    check("subgroup broadcast", t, torch.tensor([float(members[-1])]))
    # Roots given as job ranks (torch makes them the group's), each collective against exact values.
    mine_of = [torch.arange(4.0) + 10 * r for r in members]
    t = torch.arange(4.0) + 10 * rank
    dist.reduce(t, dst=members[-1], group=mine)
    check("subgroup reduce", t, sum(mine_of) if rank == members[-1] else torch.arange(4.0) + 10 * rank)
    outs = [torch.zeros(4) for _ in members]
    dist.all_gather(outs, torch.arange(4.0) + 10 * rank, group=mine)
    check("subgroup all_gather", torch.stack(outs), torch.stack(mine_of))
    out = torch.zeros(4)
    dist.scatter(out, [x * 2 for x in mine_of] if rank == members[0] else None, src=members[0], group=mine)
    check("subgroup scatter", out, (torch.arange(4.0) + 10 * rank) * 2)
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * len(members)) + rank, group=mine)
    position = members.index(rank)
    check(
        "subgroup reduce_scatter_tensor",
        out,
        torch.arange(2.0 * len(members))[2 * position : 2 * position + 2] * len(members) + sum(members),
    )
    t = torch.ones(2)
    dist.all_reduce(t)  # the default group goes on beside them
    check("default group beside subgroups", t, torch.full((2,), float(world)))
    dist.destroy_process_group(mine)


def another_default_device(rank, world, check):
    """A script that sets another default device (torch.set_default_device("cuda"), as GPU
    scripts do) still gets the backend's host buffers on the host: "meta" stands in for "cuda"
    here. Each collective below makes buffers of its own (scratch pieces, non-contiguous outputs,
    received sparse parts)."""

    def mine(r, n=6, dtype=torch.float32):
        return (torch.arange(n, device="cpu") + 10 * r + 1).to(dtype)

    total = sum(mine(r) for r in range(world))
    pieces = torch.cat([mine(r, 3) for r in range(world)])
    with torch.device("meta"):
        t = mine(rank)
        dist.reduce(t, dst=0)
        check("default meta: reduce", t, total if rank == 0 else mine(rank))
        outs = [torch.zeros(6, device="cpu") for _ in range(world)] if rank == 0 else None
        dist.gather(mine(rank), outs, dst=0)
        if rank == 0:
            check("default meta: gather", torch.stack(outs), torch.stack([mine(r) for r in range(world)]))
        out = torch.zeros(6, device="cpu")
        dist.scatter(out, [mine(r) for r in range(world)] if rank == 0 else None, src=0)
        check("default meta: scatter", out, mine(rank))
        strided = torch.zeros(6, 2, device="cpu")[:, 0]  # a non-contiguous output: staged through a buffer
        dist.scatter(strided, [mine(r) for r in range(world)] if rank == 0 else None, src=0)
        check("default meta: non-contiguous output", strided, mine(rank))
        out = torch.zeros(3 * world, device="cpu")
        dist.all_to_all_single(out, torch.cat([mine(rank, 3)] * world))
        check("default meta: all_to_all_single", out, pieces)
        sparse = torch.sparse_coo_tensor(
            torch.tensor([[rank]], device="cpu"), torch.tensor([1.0], device="cpu"), (world,), device="cpu"
        )
        dist.all_reduce(sparse)
        check("default meta: sparse all_reduce", sparse.to_dense(), torch.ones(world, device="cpu"))


SLEEP = 1_000_000_000  # GPU cycles: about half a second, far longer than a collective of 4 MiB


def stream_order(rank, world, check):
    """CUDA: the order of a collective's copies against the caller's stream (its own, not
    synchronized with the default stream, on which the backend's thread copies results back).
    Each race is provoked by a GPU-side sleep on the stream whose work must come first, and
    checked to be still running when the host saw the collective end."""
    n = 1 << 20
    total = float(sum(range(1, world + 1)))
    side = torch.cuda.Stream()

    def busy(stream):
        return torch.tensor([not stream.query()])

    # Each shape once first, so that the pinned host buffers of the races come from torch's cache:
    # a new one (cudaHostAlloc) may wait for the whole device, a sleep included.
    dist.all_reduce(torch.zeros(n))
    dist.broadcast(torch.zeros(n), src=0)
    dist.all_to_all_single(torch.empty(world * 4), torch.zeros(world * 4))
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        x = torch.zeros(n)
        torch.cuda._sleep(SLEEP)
        x.fill_(rank + 1.0)  # the producer, late
        dist.all_reduce(x)
        check("cuda: the input is read after its producer", x, torch.full((n,), total))
        dist.barrier()
        z = torch.empty(n)
        if rank:  # off the root, the output is not read: its result must land after this late write
            torch.cuda._sleep(SLEEP)
        z.fill_(float(rank))
        work = dist.broadcast(z, src=0, async_op=True)
        while not work.is_completed():
            time.sleep(0.001)
        if rank:
            check(
                "cuda: the caller's write was still queued when the broadcast ended", busy(side), torch.tensor([True])
            )
        work.wait()
        check("cuda: the result lands after the caller's last write", z, torch.zeros(n))
        y = torch.full((n,), rank + 1.0)
        pieces = torch.arange(world * 4, dtype=torch.float32) + 100 * rank  # 4 elements for each rank
        got = torch.full((world * 4,), -1.0)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.cuda.stream(torch.cuda.default_stream()):
            torch.cuda._sleep(SLEEP)  # the copies back queue behind this
        works = [dist.all_reduce(y, async_op=True), dist.all_to_all_single(got, pieces, async_op=True)]
        for work in works:
            work.wait()
        seen_y, seen_got = y.clone(), got.clone()  # before anything waits on the host
        check(
            "cuda: the copies back were still queued when wait() returned",
            busy(torch.cuda.default_stream()),
            torch.tensor([True]),
        )
        check("cuda: all_reduce's result is seen by the waiting stream", seen_y, torch.full((n,), total))
        want = torch.cat([torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + 100 * j for j in range(world)])
        check("cuda: all_to_all_single's result is seen by the waiting stream", seen_got, want)
    torch.cuda.synchronize()


if __name__ == "__main__":
    report(main())
