"""`reduction-server bench netem`: an emulated cluster on one machine, where link bandwidth, not
CPU, is the limit: the case a reduction server is for.

Every host (worker or reducer) is a network namespace with one veth link to a switch: a bridge
in a namespace of its own (so the host's firewall rules never see the traffic). Both directions
of every link are shaped to the same rate with tbf, and optionally delayed with netem (each
direction of each link, so a round trip between two hosts crosses the delay four times; netem
releases a packet's socket memory when it takes the packet, so with a delay TCP's small-queue
limit no longer holds a host's backlog back, and RS_SNDBUF's effect differs from a run without).
Addresses come from the benchmarking range 198.18.0.0/15. The reduction server (W workers, R
reducer hosts) and torch.distributed's Gloo ring (W workers) run on the same emulated hosts in
the same run.

Bounds, per worker link of B bytes/s: a reduction server needs S/B per all-reduce of S bytes
(each worker sends S and receives S, full duplex) when the reducers' links add up to the
workers' (R = W here, all links equal); a ring needs 2(W-1)/W x S/B.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from tqdm import tqdm

from reduction_server.errors import ConfigError
from reduction_server.settings import TUNING, tuning

COLUMNS = ["peer", "W", "R", "mbit", "delay_ms", "mib", "ms", "ms_range", "algbw_GBps", "bound_GBps", "of_bound",
           "vs_gloo"]
_PYTHON = sys.executable
_ALLREDUCE_JOB = "reduction_server.bench.allreduce_job"
_REDUCER_PORT = 5555
_GLOO_PORT = 29500


#: the bridge's netfilter hooks (net.bridge.bridge-nf-call-*), off in the switch namespace
BRIDGE_NETFILTER = ("iptables", "ip6tables", "arptables")


#: longest link delay the suites accept (each direction of each link): netem's queue (NETEM_LIMIT
#: packets) must hold a delay's worth of packets at the link rate
MAX_DELAY_MS = 1000.0
NETEM_LIMIT = 100_000  # 1 s at 1 Gbit/s is ~85K full-size packets
#: most hosts (workers and reducers) in one emulated network: their addresses share one /24
MAX_HOSTS = 250


def _run(*argv: str) -> None:
    """Run an ip or tc command; a failure names the command and carries its own words."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")


def _ip(*args: str) -> None:
    _run("ip", *args)


def _tc(namespace: str, *args: str) -> None:
    _run("tc", "-n", namespace, *args)


def check_delay(delay_ms: float) -> None:
    """Refuse a link delay out of range (nan too) before anything is built."""
    if not 0 <= delay_ms <= MAX_DELAY_MS:
        raise ValueError(f"the link delay must be in 0..{MAX_DELAY_MS:g} ms, got {delay_ms:g}")


def plan_runs(worlds: Sequence[int], rates_mbit: Sequence[float], reducers: Optional[Sequence[int]], rounds: int,
              delay_ms: float, variants: Sequence[Dict[str, str]]
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
            raise ValueError(f"W={world} workers and R={r} reducers are {world + r} hosts; an emulated network "
                             f"has at most {MAX_HOSTS}")
    return jobs, ours


class EmulatedNetwork:
    """`hosts` namespaces on a switch, every link shaped to `rate_mbit` both ways and, with
    `delay_ms`, each direction of each link delayed that long."""

    def __init__(self, hosts: int, rate_mbit: float, delay_ms: float = 0.0) -> None:
        if os.geteuid() != 0:
            raise PermissionError("the emulated network needs root (network namespaces, veth links and tc); "
                              "run `reduction-server bench netem` or `bench ddp` as root")
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in 1..{MAX_HOSTS}, got {hosts}")
        check_delay(delay_ms)
        self.hosts = hosts
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.tag = f"rs{os.getpid()}"  # unique per run: several runs never collide
        self.switch = f"{self.tag}-sw"
        self._procs: List[subprocess.Popen] = []
        self._namespaces: List[str] = []
        self._links: List[str] = []  # veth ends made: one still in this namespace survives its hosts

    def namespace(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def interface(self, i: int) -> str:
        return f"{self.tag}h{i}"  # at most 15 characters (IFNAMSIZ)

    @staticmethod
    def address(i: int) -> str:
        return f"198.18.0.{i + 1}"

    def __enter__(self) -> "EmulatedNetwork":
        atexit.register(self.close)  # a crash between here and __exit__ still cleans up
        try:
            self._add_namespace(self.switch)
            if self.delay_ms:
                self._probe_netem()
            self._plain_bridge()
            _ip("-n", self.switch, "link", "add", "name", "swbr", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "swbr", "up")
            for i in range(self.hosts):
                self._add_host(i)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        # Recorded before it exists: an interrupt while `ip netns add` runs leaves the namespace
        # made but the call unfinished, and close() must still delete it.
        self._namespaces.append(name)
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _plain_bridge(self) -> None:
        """Bridged frames skip the host's firewall hooks in the switch namespace. Where the
        br_netfilter module is loaded (Docker loads it) every frame crossing the bridge otherwise
        runs through iptables: CPU that no real switch costs its hosts, taken from the processes
        the emulation measures (it cost this project 0.02-0.05 of the link bound at 200 Mbit/s)."""
        for table in BRIDGE_NETFILTER:
            path = f"/proc/sys/net/bridge/bridge-nf-call-{table}"
            if os.path.exists(path):  # absent where br_netfilter is not loaded: nothing to switch off
                _ip("netns", "exec", self.switch, "sysctl", "-qw", f"net.bridge.bridge-nf-call-{table}=0")

    def _probe_netem(self) -> None:
        """Refuse a delay, before any host exists, where the kernel has no netem qdisc."""
        try:
            _tc(self.switch, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
        except RuntimeError as exc:
            raise OSError(f"a link delay needs the kernel's netem queueing discipline (sch_netem), which this "
                          f"machine does not offer ({exc}); run without a delay") from None
        _tc(self.switch, "qdisc", "del", "dev", "lo", "root")

    def _add_host(self, i: int) -> None:
        ns, host_end, switch_end = self.namespace(i), self.interface(i), f"{self.tag}s{i}"
        self._add_namespace(ns)
        # Both ends, before they exist: an interrupt may come between any two of these steps, and
        # the end still in this namespace (host's or switch's) outlives the namespaces' deletion.
        self._links += [host_end, switch_end]
        _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
        _ip("link", "set", host_end, "netns", ns)
        _ip("link", "set", switch_end, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", switch_end, "master", "swbr", "up")
        _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", host_end)
        _ip("-n", ns, "link", "set", host_end, "up")
        # Shape the host's upload (its end) and its download (the switch's end toward it); with a
        # delay, netem holds packets first and tbf (its child) shapes them.
        shape = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "200ms"]
        for where, dev in ((ns, host_end), (self.switch, switch_end)):
            if self.delay_ms:
                _tc(where, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms:g}ms",
                    "limit", str(NETEM_LIMIT))
                _tc(where, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *shape)
            else:
                _tc(where, "qdisc", "add", "dev", dev, "root", *shape)

    def spawn(self, i: int, argv: Sequence[str], env: Dict[str, str]) -> subprocess.Popen:
        """Start argv on host i; its output is read by the caller; it dies with the network."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *argv], env=env, cwd="/",
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        self._procs.append(proc)
        return proc

    def stop(self, procs: Sequence[subprocess.Popen]) -> None:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        """Stop every process and delete every namespace (the veths in them go with them) and a
        veth pair an interrupt left in this namespace, between its creation and its move."""
        self.stop([p for p in self._procs if p.poll() is None])
        self._procs.clear()
        for name in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._namespaces.clear()
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)  # gone already, mostly
        self._links.clear()
        atexit.unregister(self.close)


_PLACEMENT = ("CLUSTER_SPEC", "TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# The emulated hosts inherit this project's TUNING settings (reduction_server/settings.py):
# `RS_PIPELINE_DEPTH=24 reduction-server bench netem` measures that depth.


def _env(extra: Dict[str, str]) -> Dict[str, str]:
    """This machine's environment without any rank placement of its own (but with its TUNING),
    plus `extra`; one thread per process, as many processes share few cores."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("RS_") or k in TUNING) and k not in _PLACEMENT}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def _collect(net: EmulatedNetwork, workers: List[subprocess.Popen], what: str, timeout: float,
             marker: str) -> List[Dict]:
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


def run_reduction_server(net: EmulatedNetwork, world: int, reducers: int, job: str, args: Sequence[str],
                         marker: str, timeout: float = 600, settings: Optional[Dict[str, str]] = None,
                         victim: Optional[int] = None) -> List[Dict]:
    """`python -m JOB rs ARGS` on hosts 0..W-1 with reducers on hosts W..W+R-1, all of them with
    `settings` (TUNING variables) in their environment; rank 0's JSON lines that start with `marker`.
    `victim`: a reducer whose pid the job is told (`--victim-pid`), for a job that kills it."""
    token = os.urandom(16).hex()
    settings = settings or {}
    addresses = [f"{net.address(world + j)}:{_REDUCER_PORT}" for j in range(reducers)]
    servers = [net.spawn(world + j, [_PYTHON, "-m", "reduction_server", "serve", "--host", net.address(world + j),
                                     "--port", str(_REDUCER_PORT), "--workers", str(world), "--index", str(j),
                                     "--shards", "1"],  # the emulated hosts share this machine's cores
                         _env({"RS_JOB_TOKEN": token, **settings})) for j in range(reducers)]
    try:
        for j, proc in enumerate(servers):
            line = proc.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"reducer {j} did not start: {line}{proc.stdout.read()}")
        if victim is not None:  # `ip netns exec` execs the command: the process is the reducer
            args = [*args, "--victim-pid", str(servers[victim].pid)]
        workers = [net.spawn(i, [_PYTHON, "-m", job, "rs", *args],
                             _env({"RS_JOB_TOKEN": token, "RS_REDUCERS": ",".join(addresses), "RS_RANK": str(i),
                                   "RS_WORLD_SIZE": str(world), **settings})) for i in range(world)]
        return _collect(net, workers, f"reduction-server W={world} R={reducers}", timeout, marker)
    finally:
        net.stop(servers)


def run_gloo(net: EmulatedNetwork, world: int, job: str, args: Sequence[str], marker: str,
             timeout: float = 600) -> List[Dict]:
    """`python -m JOB gloo ARGS` on hosts 0..W-1 (each rank told its interface: Gloo would pick
    lo otherwise); rank 0's JSON lines that start with `marker`."""
    workers = [net.spawn(i, [_PYTHON, "-m", job, "gloo", *args],
                         _env({"RANK": str(i), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                               "MASTER_ADDR": net.address(0), "MASTER_PORT": str(_GLOO_PORT),
                               "GLOO_SOCKET_IFNAME": net.interface(i)})) for i in range(world)]
    return _collect(net, workers, f"gloo W={world}", timeout, marker)


def run(worlds: Sequence[int] = (2, 4, 8), rates_mbit: Sequence[float] = (200,), sizes_mib: Sequence[float] = (4, 16),
        reducers: Optional[Sequence[int]] = None, iters: int = 3, rounds: int = 1, delay_ms: float = 0.0,
        variants: Sequence[Dict[str, str]] = ()) -> List[Dict]:
    """Rows for Gloo and this project on each W x R x link rate, each size (R = W unless given),
    and for this project again under each of `variants` (settings, parse_variant); with rounds > 1
    the peers take turns on the same network and each row gives the median. Every argument is
    checked before the first network is built."""
    if min(worlds) < 2:
        raise ValueError(f"a ring needs at least 2 workers, got W={min(worlds)}")
    jobs, ours = plan_runs(worlds, rates_mbit, reducers, rounds, delay_ms, variants)
    args = ["--mib", ",".join(f"{s:g}" for s in sizes_mib), "--iters", str(iters)]
    rows: List[Dict] = []
    with cleanup_on_sigterm():
        for world, rate, r in tqdm(jobs, desc="netem", unit="job"):
            rows += _measure(world, rate, r, sizes_mib, args, rounds, delay_ms, ours)
    return rows


def medians(runs: Sequence[float]) -> Dict:
    """The median of a peer's seconds over its rounds, and their range as text (how noisy the
    machine was: this one is shared, and a single run moves 10-25 %)."""
    return {"seconds": statistics.median(runs), "range": f"{min(runs) * 1e3:.0f}-{max(runs) * 1e3:.0f}"}


@contextlib.contextmanager
def cleanup_on_sigterm() -> Iterator[None]:
    """Delete the namespaces of SIGKILLed runs first; turn SIGTERM into an exit meanwhile, so that
    every network's cleanup runs."""
    for name in stale_namespaces():
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for link in stale_links():
        subprocess.run(["ip", "link", "del", link], capture_output=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _measure(world: int, rate: float, r: int, sizes_mib: Sequence[float], args: List[str],
             rounds: int, delay_ms: float, variants: List[Tuple[str, Dict[str, str]]]) -> List[Dict]:
    link = rate * 1e6 / 8  # bytes/s per host, each way
    gloo: List[List[Dict]] = []
    ours: Dict[str, List[List[Dict]]] = {label: [] for label, _ in variants}
    with EmulatedNetwork(world + r, rate, delay_ms) as net:
        for _ in range(rounds):  # in turns, so that the peers meet the same quiet and busy moments
            gloo.append(run_gloo(net, world, _ALLREDUCE_JOB, args, '{"bytes"'))
            for label, settings in variants:
                ours[label].append(run_reduction_server(net, world, r, _ALLREDUCE_JOB, args, '{"bytes"',
                                                        settings=settings))
    # S/B when the reducers' links add up to the workers'; their total limits it otherwise.
    ours_bound = link * min(1.0, r / world) / 1e9
    ring_bound = link * world / (2 * (world - 1)) / 1e9
    rows = []
    for i, mib in enumerate(sizes_mib):
        nbytes = gloo[0][i]["bytes"]
        g = medians([run[i]["seconds"] for run in gloo])
        points = [("gloo", g, ring_bound, "-")] + [
            (label, medians([run[i]["seconds"] for run in runs]), ours_bound, r) for label, runs in ours.items()]
        for peer, point, bound, reducers in points:
            algbw = nbytes / point["seconds"] / 1e9
            rows.append({"peer": peer, "W": world, "R": reducers, "mbit": rate, "delay_ms": delay_ms, "mib": mib,
                         "rounds": rounds,
                         "ms": point["seconds"] * 1e3, "ms_range": point["range"], "algbw_GBps": algbw,
                         "bound_GBps": bound, "of_bound": algbw / bound, "vs_gloo": g["seconds"] / point["seconds"]})
    return rows


def stale_links() -> List[str]:
    """Ends of veth pairs (a host's or the switch's) left in this namespace by runs whose process
    is gone (SIGKILLed while adding a host)."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [name for name, pid in re.findall(r"^\d+: (rs(\d+)[hs]\d+)@", out, re.M)
            if not os.path.exists(f"/proc/{pid}")]


def stale_namespaces() -> List[str]:
    """Namespaces of runs whose process is gone (a SIGKILLed benchmark)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    stale = []
    for name in names:
        match = re.fullmatch(r"rs(\d+)-(sw|h\d+)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            stale.append(name)
    return stale
