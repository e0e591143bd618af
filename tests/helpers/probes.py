"""What a test reads of a running process: its memory and its open files."""

from __future__ import annotations

import os
import time
from typing import Optional

import psutil


def rss(pid: int) -> int:
    """Resident memory of the process and its children (a sharded reducer's shards), bytes."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def open_fds(pid: int) -> int:
    return psutil.Process(pid).num_fds()


def fd_targets(pid: int) -> list:
    """What each of the process's file descriptors is (a path, socket:[inode], anon_inode:...)."""
    targets = []
    for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        try:
            targets.append(f"{fd}->{os.readlink(f'/proc/{pid}/fd/{fd}')}")
        except OSError:  # closed meanwhile
            continue
    return targets


def settled_fds(pid: int, expected: Optional[int], limit: float = 5.0) -> int:
    """The process's open files once closing connections have been closed (at most `limit` s)."""
    deadline = time.monotonic() + limit
    count = open_fds(pid)
    while count != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        count = open_fds(pid)
    return count
