"""One rank of a timed job of torch.distributed's sharding collectives: `python -m
reduction_server.bench.collectives_job BACKEND --mib 4,16 --iters 3`. For each size S (the full
tensor, float32), reduce_scatter_tensor (S in, S/W out) and all_gather_into_tensor (S/W in, S
out), each checked against its exact result and timed between barriers after one untimed call;
rank 0 prints one JSON line per collective and size.

BACKEND: rs (`init_process_group("reduction_server")`, placed by the RS_* variables), gloo
(placed by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT).
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

from reduction_server.bench.gloo_exit import exit_now


def _timed(call, iters: int) -> float:
    call()  # untimed: connections, buffers
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    dist.barrier()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["rs", "gloo"])
    parser.add_argument("--mib", default="4,16", help="full tensor sizes in MiB, comma-separated")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per collective and size")
    args = parser.parse_args()
    torch.set_num_threads(1)  # many ranks share few cores
    if args.backend == "rs":
        import reduction_server.client.torch  # noqa: F401  (registers the backend)

        dist.init_process_group("reduction_server")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mib in (float(m) for m in args.mib.split(",")):
        n = int(mib * (1 << 20) / 4) // world * world
        full = torch.arange(n, dtype=torch.float32) % 97 + rank  # rank r's input to reduce_scatter
        shard = torch.empty(n // world)
        gathered = torch.empty(n)
        seconds = _timed(lambda shard=shard, full=full: dist.reduce_scatter_tensor(shard, full), args.iters)
        piece = slice(rank * (n // world), (rank + 1) * (n // world))
        want = (torch.arange(n, dtype=torch.float32)[piece] % 97) * world + sum(range(world))
        assert torch.equal(shard, want), "reduce_scatter_tensor gave a wrong result"
        results = [("reduce_scatter_tensor", seconds)]
        seconds = _timed(lambda out=gathered, shard=shard: dist.all_gather_into_tensor(out, shard), args.iters)
        want = torch.cat(
            [
                (torch.arange(n, dtype=torch.float32)[r * (n // world) : (r + 1) * (n // world)] % 97) * world
                + sum(range(world))
                for r in range(world)
            ]
        )
        assert torch.equal(gathered, want), "all_gather_into_tensor gave a wrong result"
        results.append(("all_gather_into_tensor", seconds))
        if rank == 0:
            for name, secs in results:
                print(json.dumps({"collective": name, "mib": mib, "seconds": secs, "iters": args.iters}), flush=True)
    dist.destroy_process_group()
    if args.backend == "gloo":
        exit_now()


if __name__ == "__main__":
    main()
