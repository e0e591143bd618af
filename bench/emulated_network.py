"""An emulated cluster on one machine (root): every host a network namespace with one veth link
to a switch, a bridge in a namespace of its own (so the host's firewall rules never see the
traffic). Both directions of every link are shaped to the same rate with tbf, and optionally
delayed with netem (each direction of each link, so a round trip between two hosts crosses the
delay four times; netem releases a packet's socket memory when it takes the packet, so with a
delay TCP's small-queue limit no longer holds a host's backlog back, and RS_SNDBUF's effect
differs from a run without). Addresses come from the benchmarking range 198.18.0.0/15. The
netem, ddp, collectives and failover suites run their peers on it."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, Iterator, List, Sequence

from reduction_server.children import AWAY_FROM_SOURCE

#: the bridge's netfilter hooks (net.bridge.bridge-nf-call-*), off in the switch namespace
BRIDGE_NETFILTER = ("iptables", "ip6tables", "arptables")


#: longest link delay the suites accept (each direction of each link): netem's queue (NETEM_LIMIT
#: packets) must hold a delay's worth of packets at the link rate
MAX_DELAY_MS = 1000.0
NETEM_LIMIT = 100_000  # 1 s at 1 Gbit/s is ~85K full-size packets
#: each link's token bucket (tbf's burst): what a link that idled may send at once
TBF_BURST_BYTES = 256 * 1024
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


class EmulatedNetwork:
    """`hosts` namespaces on a switch, every link shaped to `rate_mbit` both ways (host i's to
    `host_rates_mbit[i]` where given) and, with `delay_ms`, each direction of each link delayed
    that long."""

    def __init__(
        self, hosts: int, rate_mbit: float, delay_ms: float = 0.0, host_rates_mbit: Sequence[float] = ()
    ) -> None:
        if os.geteuid() != 0:
            raise PermissionError(
                "the emulated network needs root (network namespaces, veth links and tc); "
                "run `reduction-server bench netem` or `bench ddp` as root"
            )
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in 1..{MAX_HOSTS}, got {hosts}")
        check_delay(delay_ms)
        if len(host_rates_mbit) > hosts or not all(rate > 0 for rate in (rate_mbit, *host_rates_mbit)):
            raise ValueError(f"link rates must be positive, at most one per host: {rate_mbit}, {list(host_rates_mbit)}")
        self.hosts = hosts
        self.rate_mbit = rate_mbit
        self.host_rates_mbit = list(host_rates_mbit)
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

    def rate_of(self, i: int) -> float:
        """Host i's link rate, Mbit/s each way."""
        return self.host_rates_mbit[i] if i < len(self.host_rates_mbit) else self.rate_mbit

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
            raise OSError(
                f"a link delay needs the kernel's netem queueing discipline (sch_netem), which this "
                f"machine does not offer ({exc}); run without a delay"
            ) from None
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
        shape = ["tbf", "rate", f"{self.rate_of(i)}mbit", "burst", f"{TBF_BURST_BYTES}b", "latency", "200ms"]
        for where, dev in ((ns, host_end), (self.switch, switch_end)):
            if self.delay_ms:
                _tc(
                    where,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "handle",
                    "1:",
                    "netem",
                    "delay",
                    f"{self.delay_ms:g}ms",
                    "limit",
                    str(NETEM_LIMIT),
                )
                _tc(where, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *shape)
            else:
                _tc(where, "qdisc", "add", "dev", dev, "root", *shape)

    def spawn(self, i: int, argv: Sequence[str], env: Dict[str, str]) -> subprocess.Popen:
        """Start argv on host i; its output is read by the caller; it dies with the network."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(i), *argv],
            env=env,
            cwd=AWAY_FROM_SOURCE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
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


def stale_links() -> List[str]:
    """Ends of veth pairs (a host's or the switch's) left in this namespace by runs whose process
    is gone (SIGKILLed while adding a host)."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [
        name for name, pid in re.findall(r"^\d+: (rs(\d+)[hs]\d+)@", out, re.M) if not os.path.exists(f"/proc/{pid}")
    ]


def stale_namespaces() -> List[str]:
    """Namespaces of runs whose process is gone (a SIGKILLed benchmark)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    stale = []
    for name in names:
        match = re.fullmatch(r"rs(\d+)-(sw|h\d+)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            stale.append(name)
    return stale
