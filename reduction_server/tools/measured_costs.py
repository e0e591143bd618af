"""The measured constants of the step-time model (`size --simulate`), each declared once with
where it was measured (bench/RESULTS.md, "Reducer CPU cost and sizing"; 2 vCPU x86-64 VM,
AVX-512, Python 3.11, tcp). A user with other hosts passes their own `Costs`."""

from __future__ import annotations

from dataclasses import dataclass

GIB = float(1 << 30)


@dataclass(frozen=True)
class Costs:
    """CPU seconds per unit of work; the defaults are this project's measurements."""

    #: a reducer shard's CPU (all its threads) per GiB of incoming gradient: `bench reducer`
    #: with 4 shards, W=2 and W=4, 2 MiB chunks, medians of 7 runs 0.66 and 0.655 (2026-11-27,
    #: ab31540): a host runs one shard per core, and 4 shards is the nearest measured to that
    #: (1 shard: 0.442-0.489, but one shard cannot use a second core)
    reducer_cpu_s_per_gib: float = 0.655
    #: a reducer's CPU per contribution beyond its bytes: W=8, 64 KiB float32, real sockets over
    #: inproc, 19.9 / 18.1 / 23.2 us in 3 runs (2026-11-23)
    reducer_s_per_contribution: float = 20e-6
    #: a worker engine's CPU per chunk: W=1, tcp loopback, 48-58 us (2026-11-23)
    worker_s_per_chunk: float = 53e-6
    #: a worker's CPU per GiB it sends and receives back: the both-ways copy limit of `bench
    #: reducer` (a reflector returning every message over tcp, W=2 and W=4: 0.462-0.508 and
    #: 0.501-0.575 CPU-s/GiB, 2026-11-27, ab31540): a worker moves its gradient out and the sum in
    #: as the reflector does, without summing
    worker_cpu_s_per_gib: float = 0.51


#: the project's measurements, the model's defaults
MEASURED = Costs()
