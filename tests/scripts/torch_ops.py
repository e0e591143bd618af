"""One rank: plain torch.distributed collectives through init_process_group("reduction_server")
(no MASTER_ADDR: the discovery-only rendezvous). Checks every result against what each rank's
known inputs give and prints {"rank", "done", "failures"} as one JSON line."""
import os

import torch
import torch.distributed as dist

import reduction_server.client.torch  # noqa: F401  (registers the backend)
from report import report  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8,
          torch.uint8]
OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "PRODUCT": dist.ReduceOp.PRODUCT,
       "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX}


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
            def pattern(k):
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
            check(f"all_gather {dtype} slot {r}",
                  outs[r], (torch.arange(torch.Size(shape).numel()).reshape(shape) + 100 * r).to(dtype))
    work = dist.barrier(async_op=True)
    work.wait()
    dist.barrier()
    done += 1
    # all_gather_object goes through allgather of bytes.
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    check("all_gather_object", torch.tensor([o["rank"] for o in objs]), torch.arange(world))
    # A second group over all ranks shares the Communicator; a subgroup is refused clearly.
    whole = dist.new_group(list(range(world)))
    t = torch.ones(3)
    dist.all_reduce(t, group=whole)
    check("new_group all ranks", t, torch.full((3,), float(world)))
    if world > 1:
        try:
            dist.new_group([0])  # the creator runs on rank 0 only (the others are not members)
            if rank == 0:
                failures.append("a subgroup was created")
        except (NotImplementedError, RuntimeError) as exc:
            if "one group of all" not in str(exc):
                failures.append(f"subgroup: unclear error {exc}")
    t = torch.ones(3)
    dist.all_reduce(t)
    check("default group after new_group", t, torch.full((3,), float(world)))
    backend = dist.get_backend()
    dist.destroy_process_group()
    return {"rank": rank, "done": done, "failures": failures[:20], "backend": backend}


if __name__ == "__main__":
    report(main())
