"""The child processes of a local job: each in a process group of its own that dies with the
launcher, its output copied line by line with a prefix, and all of them stopped as a whole."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable, Optional, Sequence

POLL_S = 0.05  # how often the launcher looks for exited children
# Where the package's own children (reducers, shards, benchmark jobs) start: `python -m` puts its
# working directory first on sys.path, and from a source checkout's root that is the uncompiled
# tree (no _native), not the installed package. The root directory cannot hold a checkout's root.
AWAY_FROM_SOURCE = "/"
_MAX_LINE = 64 * 1024  # longer lines are printed in pieces rather than buffered without bound
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass
class Child:
    """A started child process and the label its output lines carry."""

    label: str  # the output prefix: "rank 3" or "reducer 1"
    proc: subprocess.Popen[bytes]


def die_with_parent_hook() -> Optional[Callable[[], None]]:
    """A preexec_fn that makes the child get SIGKILL when the launcher dies, even by SIGKILL.

    Linux only (prctl); elsewhere children rely on the launcher's own cleanup. Strictly, the
    signal comes when the forking *thread* exits: run_job forks and waits in the same thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork: no dlopen in the child
    launcher = os.getpid()

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL))
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return die_with_parent


def copy_output(stream: IO[bytes], prefix: str, lock: threading.Lock) -> None:
    """Copy a child's output to our stdout, one prefixed whole line at a time."""
    with stream:
        for raw in iter(lambda: stream.readline(_MAX_LINE), b""):
            # A partial last line has no newline; junk bytes must not stop the copying.
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with lock:
                try:
                    sys.stdout.write(f"{prefix}{line}\n")
                    sys.stdout.flush()
                except (OSError, ValueError):
                    pass  # our stdout is gone (closed pipe): keep draining so the child never blocks


def peek_exit(proc: subprocess.Popen[bytes]) -> Optional[int]:
    """The child's status, Popen-style (negative: killed by that signal), None while it runs.

    It does not reap the child: while a zombie holds its PID, that number (also its process
    group's id) cannot be reused, so a later killpg cannot hit an unrelated process.
    """
    if proc.returncode is not None or not hasattr(os, "waitid"):
        return proc.poll()
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def wait_briefly(proc: subprocess.Popen[bytes], seconds: float = 5.0) -> Optional[int]:
    """The child's status once it has exited (within `seconds`; not reaped), else None."""
    deadline = time.monotonic() + seconds
    while (status := peek_exit(proc)) is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return status


def close_all(fds: Sequence[int]) -> None:
    """Close every descriptor in fds that is still open."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def stop_all(children: Sequence[Child], grace: float) -> None:
    """SIGTERM every child's process group, SIGKILL whatever is left after `grace`, reap all."""
    _signal_groups(children, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(peek_exit(child.proc) is None for child in children):
        time.sleep(POLL_S)
    # Also the groups whose leader has exited: grandchildren may still be in them.
    _signal_groups(children, signal.SIGKILL)
    for child in children:
        child.proc.wait()


def _signal_groups(children: Sequence[Child], signum: int) -> None:
    for child in children:
        if child.proc.returncode is None:  # not reaped yet, so its group id is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signum)


def describe(status: int) -> str:
    if status < 0:
        return f"was killed by signal {-status} ({signal_name(-status)})"
    return f"exited with code {status}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # e.g. a real-time signal without a name of its own
        return f"signal {signum}"


def exit_code(status: int) -> int:
    return 128 - status if status < 0 else status
