"""Who holds a TCP port on this host: what a reducer or `run` names when a port it needs is taken,
so that the message says which process to stop (read from /proc, so Linux only)."""

from __future__ import annotations

import os
from typing import Optional


def port_holder(port: int) -> Optional[str]:
    """Who listens on TCP `port` on this host, as `pid N (its command line)`, read from /proc;
    None when no listener is found there (or there is no /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in list(f)[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(f"socket:[{fields[9]}]")
        except (OSError, ValueError, IndexError):
            continue
    if not inodes:
        return None
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {pid} ({command[:100] + ('...' if len(command) > 100 else '')})"
        except OSError:
            continue
    return "a process of another user"
