"""`reduction-server bench netem`: an emulated cluster on one machine (emulated_network.py), where
link bandwidth, not CPU, is the limit: the case a reduction server is for. The reduction server
(W workers, R reducer hosts) and torch.distributed's Gloo ring (W workers) run on the same
emulated hosts in the same run.

Bounds, per worker link of B bytes/s: a reduction server needs S/B per all-reduce of S bytes
(each worker sends S and receives S, full duplex) when the reducers' links add up to the
workers' (R = W here, all links equal); a ring needs 2(W-1)/W x S/B.

Compression (`--compression none,int8,bf16`): this project runs once more per format (the buffer
stays float32, `compression=` says what travels), and Gloo once more for a 16-bit format (a
bfloat16 or float16 tensor through the ring: what a DDP user's bf16 hook sends). S, the bounds and
algbw stay the float32 buffer's, so a compressed run can pass its bound; `vs_float32` is this
project's float32 time (the defaults) over the row's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from reduction_server.client import compression
from reduction_server.config.settings import TUNING, tuning
from reduction_server.errors import ConfigError

from .emulated_network import MAX_HOSTS, EmulatedNetwork, check_delay, cleanup_on_sigterm

COLUMNS = [
    "peer",
    "compression",
    "W",
    "R",
    "mbit",
    "reducer_mbit",
    "delay_ms",
    "mib",
    "ms",
    "ms_range",
    "algbw_GBps",
    "bound_GBps",
    "of_bound",
    "vs_gloo",
    "vs_float32",
]
#: the formats a Gloo ring also sends, as a tensor of that dtype (allreduce_job's --dtype)
GLOO_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_PYTHON = sys.executable
_ALLREDUCE_JOB = "reduction_server.bench.allreduce_job"
_REDUCER_PORT = 5555
_GLOO_PORT = 29500


def plan_runs(
    worlds: Sequence[int],
    rates_mbit: Sequence[float],
    reducers: Optional[Sequence[int]],
    rounds: int,
    delay_ms: float,
    variants: Sequence[Dict[str, str]],
) -> Tuple[List[Tuple[int, float, int]], List[Tuple[str, Dict[str, str]]]]:
    """What a suite runs: (W, rate, R) for every emulated network it builds (R = W unless given)
    and (label, settings) for this project's runs on each (variant_runs); all of it checked before
    the first network is built, so that a bad argument costs no run."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    check_delay(delay_ms)
    ours = variant_runs(variants)
    jobs = [(w, rate, r) for w in worlds for rate in rates_mbit for r in (reducers or [w])]
    for world, _, r in jobs:
        if world + r > MAX_HOSTS:
            raise ValueError(
                f"W={world} workers and R={r} reducers are {world + r} hosts; an emulated network "
                f"has at most {MAX_HOSTS}"
            )
    return jobs, ours


_PLACEMENT = ("CLUSTER_SPEC", "TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# The emulated hosts inherit this project's TUNING settings (reduction_server/config/settings.py):
# `RS_PIPELINE_DEPTH=24 reduction-server bench netem` measures that depth.


def _env(extra: Dict[str, str]) -> Dict[str, str]:
    """This machine's environment without any rank placement of its own (but with its TUNING),
    plus `extra`; one thread per process, as many processes share few cores."""
    env = {k: v for k, v in os.environ.items() if (not k.startswith("RS_") or k in TUNING) and k not in _PLACEMENT}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def _collect(
    net: EmulatedNetwork, workers: List[subprocess.Popen], what: str, timeout: float, marker: str
) -> List[Dict]:
    """Rank 0's JSON lines that start with `marker`, once every rank has exited 0."""
    outputs = []
    try:
        for rank, proc in enumerate(workers):
            out, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{what}: rank {rank} exited {proc.returncode}:\n{out[-3000:]}")
            outputs.append(out)
    finally:
        net.stop(workers)
    return [json.loads(line) for line in outputs[0].splitlines() if line.startswith(marker)]


def parse_variant(text: str) -> Dict[str, str]:
    """`RS_SNDBUF=16384,RS_WINDOW=2` -> its settings (TUNING, each validated as this project's
    processes would): one more run of this project, with them."""
    settings: Dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = (word.strip() for word in part.partition("="))
        if not sep or not name or not value:
            raise ValueError(f"--variant {text!r}: expected NAME=VALUE[,NAME=VALUE...], e.g. RS_SNDBUF=16384")
        if name not in TUNING:
            raise ValueError(f"--variant {text!r}: the emulated hosts take no {name}; choose from {', '.join(TUNING)}")
        if name in settings:
            raise ValueError(f"--variant {text!r} sets {name} twice")
        settings[name] = value
        try:
            tuning(name, environ=settings)
        except ConfigError as exc:
            raise ValueError(f"--variant {text!r}: {exc}") from None
    return settings


def variant_runs(variants: Sequence[Dict[str, str]]) -> List[Tuple[str, Dict[str, str]]]:
    """(row label, settings) for this project's runs: the defaults, then each variant; a variant
    given twice (or one that changes nothing) is refused, since its rows would merge."""
    runs: List[Tuple[str, Dict[str, str]]] = []
    for settings in ({}, *variants):
        label = " ".join(["reduction-server", *(f"{k}={v}" for k, v in settings.items())])
        if label in (seen for seen, _ in runs):
            raise ValueError(f"--variant {label.partition(' ')[2] or '(none)'} is given twice or repeats the defaults")
        runs.append((label, dict(settings)))
    return runs


def run_reduction_server(
    net: EmulatedNetwork,
    world: int,
    reducers: int,
    job: str,
    args: Sequence[str],
    marker: str,
    timeout: float = 600,
    settings: Optional[Dict[str, str]] = None,
    victim: Optional[int] = None,
) -> List[Dict]:
    """`python -m JOB rs ARGS` on hosts 0..W-1 with reducers on hosts W..W+R-1, all of them with
    `settings` (TUNING variables) in their environment; rank 0's JSON lines that start with `marker`.
    `victim`: a reducer whose pid the job is told (`--victim-pid`), for a job that kills it."""
    token = os.urandom(16).hex()
    settings = settings or {}
    addresses = [f"{net.address(world + j)}:{_REDUCER_PORT}" for j in range(reducers)]
    servers = [
        net.spawn(
            world + j,
            [
                _PYTHON,
                "-m",
                "reduction_server",
                "serve",
                "--host",
                net.address(world + j),
                "--port",
                str(_REDUCER_PORT),
                "--workers",
                str(world),
                "--index",
                str(j),
                "--shards",
                "1",
            ],  # the emulated hosts share this machine's cores
            _env({"RS_JOB_TOKEN": token, **settings}),
        )
        for j in range(reducers)
    ]
    try:
        for j, proc in enumerate(servers):
            line = proc.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"reducer {j} did not start: {line}{proc.stdout.read()}")
        if victim is not None:  # `ip netns exec` execs the command: the process is the reducer
            args = [*args, "--victim-pid", str(servers[victim].pid)]
        workers = [
            net.spawn(
                i,
                [_PYTHON, "-m", job, "rs", *args],
                _env(
                    {
                        "RS_JOB_TOKEN": token,
                        "RS_REDUCERS": ",".join(addresses),
                        "RS_RANK": str(i),
                        "RS_WORLD_SIZE": str(world),
                        **settings,
                    }
                ),
            )
            for i in range(world)
        ]
        return _collect(net, workers, f"reduction-server W={world} R={reducers}", timeout, marker)
    finally:
        net.stop(servers)


def run_gloo(
    net: EmulatedNetwork, world: int, job: str, args: Sequence[str], marker: str, timeout: float = 600
) -> List[Dict]:
    """`python -m JOB gloo ARGS` on hosts 0..W-1 (each rank told its interface: Gloo would pick
    lo otherwise); rank 0's JSON lines that start with `marker`."""
    workers = [
        net.spawn(
            i,
            [_PYTHON, "-m", job, "gloo", *args],
            _env(
                {
                    "RANK": str(i),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": "0",
                    "MASTER_ADDR": net.address(0),
                    "MASTER_PORT": str(_GLOO_PORT),
                    "GLOO_SOCKET_IFNAME": net.interface(i),
                }
            ),
        )
        for i in range(world)
    ]
    return _collect(net, workers, f"gloo W={world}", timeout, marker)


def run(
    worlds: Sequence[int] = (2, 4, 8),
    rates_mbit: Sequence[float] = (200,),
    sizes_mib: Sequence[float] = (4, 16),
    reducers: Optional[Sequence[int]] = None,
    iters: int = 3,
    rounds: int = 1,
    delay_ms: float = 0.0,
    variants: Sequence[Dict[str, str]] = (),
    compressions: Sequence[str] = ("none",),
    reducer_rates_mbit: Optional[Sequence[float]] = None,
) -> List[Dict]:
    """Rows for Gloo and this project on each W x R x link rate (x the reducers' link rate,
    default the workers'), each size (R = W unless given), and for this project again under each
    of `variants` (settings, parse_variant) and each of `compressions`; with rounds > 1 the peers
    take turns on the same network and each row gives the median. Every argument is checked
    before the first network is built."""
    if min(worlds) < 2:
        raise ValueError(f"a ring needs at least 2 workers, got W={min(worlds)}")
    jobs, ours = plan_runs(worlds, rates_mbit, reducers, rounds, delay_ms, variants)
    formats = compressed_runs(compressions)
    rows: List[Dict] = []
    with cleanup_on_sigterm():
        for links in tqdm(networks(jobs, reducer_rates_mbit), desc="netem", unit="job"):
            rows += _measure(links, sizes_mib, iters, rounds, delay_ms, ours, formats)
    return rows


def networks(jobs: Sequence[Tuple[int, float, int]], reducer_rates_mbit: Optional[Sequence[float]]) -> List["Links"]:
    """Each (W, rate, R) of plan_runs with each reducer link rate (default: the workers')."""
    if reducer_rates_mbit is not None and not all(rate > 0 for rate in reducer_rates_mbit):
        raise ValueError(f"reducer link rates must be positive, got {list(reducer_rates_mbit)}")
    return [Links(w, rate, r, rr) for w, rate, r in jobs for rr in (reducer_rates_mbit or [rate])]


def labelled(
    variants: Sequence[Tuple[str, Dict[str, str]]], formats: Sequence[str]
) -> List[Tuple[Tuple[str, str], Dict[str, str]]]:
    """((row label, format), settings) of this project's runs: each variant in each format, the
    defaults' float32 first (the row the others are measured against)."""
    return [
        ((label if name == "none" else f"{label} {name}", name), settings)
        for label, settings in variants
        for name in formats
    ]


def _job_args(sizes_mib: Sequence[float], iters: int, dtype: str = "float32") -> List[str]:
    """allreduce_job's arguments for buffers of as many elements as float32 buffers of `sizes_mib`."""
    scale = np.dtype(np.uint16 if dtype == "bfloat16" else dtype).itemsize / 4
    return ["--mib", ",".join(f"{s * scale:g}" for s in sizes_mib), "--iters", str(iters), "--dtype", dtype]


def compressed_runs(compressions: Sequence[str]) -> List[str]:
    """The formats to run (float32's `none` always first: the others are measured against it),
    each checked as Communicator.all_reduce would."""
    names = ["none", *(name for name in compressions if name != "none")]
    for name in names:
        compression.parse(name)  # a ValueError naming an unknown format
    if len(set(names)) != len(names):
        raise ValueError(f"--compression {','.join(compressions)} names a format twice")
    return names


class Links(NamedTuple):
    """One emulated network's shape: W worker hosts at `rate` Mbit/s, R reducer hosts at
    `reducer_rate` (hosts W..W+R-1)."""

    world: int
    rate: float
    reducers: int
    reducer_rate: float

    def network(self, delay_ms: float) -> EmulatedNetwork:
        return EmulatedNetwork(
            self.world + self.reducers,
            self.rate,
            delay_ms,
            host_rates_mbit=[self.rate] * self.world + [self.reducer_rate] * self.reducers,
        )

    def bounds(self) -> Tuple[float, float]:
        """GB/s of S for this project (S/B while the reducers' links add up to the workers', their
        total beyond) and for a ring (W/(2(W-1)) x B)."""
        link = self.rate * 1e6 / 8  # bytes/s per worker host, each way
        ours = link * min(1.0, self.reducers * self.reducer_rate / (self.world * self.rate))
        return ours / 1e9, link * self.world / (2 * (self.world - 1)) / 1e9


def medians(runs: Sequence[float]) -> Dict:
    """The median of a peer's seconds over its rounds, and their range as text (how noisy the
    machine was: this one is shared, and a single run moves 10-25 %)."""
    return {"seconds": statistics.median(runs), "range": f"{min(runs) * 1e3:.0f}-{max(runs) * 1e3:.0f}"}


def _measure(
    links: Links,
    sizes_mib: Sequence[float],
    iters: int,
    rounds: int,
    delay_ms: float,
    variants: List[Tuple[str, Dict[str, str]]],
    formats: List[str],
) -> List[Dict]:
    world, r = links.world, links.reducers
    args = _job_args(sizes_mib, iters)
    gloo_runs = [("gloo", "none", args)] + [
        ("gloo", name, _job_args(sizes_mib, iters, GLOO_DTYPES[name])) for name in formats if name in GLOO_DTYPES
    ]
    our_runs = labelled(variants, formats)
    times: Dict[Tuple[str, str], List[List[Dict]]] = {
        **{(peer, name): [] for peer, name, _ in gloo_runs},
        **{key: [] for key, _ in our_runs},
    }
    with links.network(delay_ms) as net:
        for _ in range(rounds):  # in turns, so that the peers meet the same quiet and busy moments
            for peer, name, gloo_args in gloo_runs:
                times[peer, name].append(run_gloo(net, world, _ALLREDUCE_JOB, gloo_args, '{"bytes"'))
            for (label, name), settings in our_runs:
                job_args = args if name == "none" else [*args, "--compression", name]
                times[label, name].append(
                    run_reduction_server(net, world, r, _ALLREDUCE_JOB, job_args, '{"bytes"', settings=settings)
                )
    ours_bound, ring_bound = links.bounds()
    float32 = our_runs[0][0]  # this project's defaults, float32
    rows = []
    for i, mib in enumerate(sizes_mib):
        nbytes = times["gloo", "none"][0][i]["bytes"]  # the float32 buffer's, whatever travels
        point = {key: medians([run[i]["seconds"] for run in runs]) for key, runs in times.items()}
        g, ours = point["gloo", "none"]["seconds"], point[float32]["seconds"]
        for (peer, name), p in point.items():
            is_gloo = peer == "gloo"
            algbw = nbytes / p["seconds"] / 1e9
            bound = ring_bound if is_gloo else ours_bound
            rows.append(
                {
                    "peer": peer,
                    "compression": name,
                    "W": world,
                    "R": "-" if is_gloo else r,
                    "mbit": links.rate,
                    "reducer_mbit": "-" if is_gloo else links.reducer_rate,
                    "delay_ms": delay_ms,
                    "mib": mib,
                    "rounds": rounds,
                    "ms": p["seconds"] * 1e3,
                    "ms_range": p["range"],
                    "algbw_GBps": algbw,
                    "bound_GBps": bound,
                    "of_bound": algbw / bound,
                    "vs_gloo": g / p["seconds"],
                    "vs_float32": "-" if is_gloo else ours / p["seconds"],
                }
            )
    return rows
