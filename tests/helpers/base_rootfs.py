"""The Docker tests' base image's root file system (Debian bookworm by debootstrap), made in the
background from the moment the session knows it will run those tests.

debootstrap spends its ~1 minute waiting on the Debian mirror, not on the CPU, so conftest.py starts
it when collection selects tests/jobs/test_docker.py and the suite's other tests run meanwhile;
test_docker.py's image fixture then takes the finished tree (`take`). Everything it makes lives
in one temporary directory, removed at the session's end (`discard`) or by the fixture.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import List, Optional

import pytest

from helpers.cluster import unreachable

MIRROR = os.environ.get("RS_DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: minbase with what the image's venv needs
COMMAND = ["debootstrap", "--variant=minbase", "--include=python3,python3-venv", "bookworm"]
_TIMEOUT = 600


def why_not() -> Optional[str]:
    """Why no root file system can be made here (a skip's reason), or None. The mirror's check
    asks the network: call it off the main thread when it may wait."""
    if shutil.which("debootstrap") is None:
        return (
            "debootstrap is not installed, so no base image can be made without pulling one "
            "(apt-get install debootstrap, or set RS_DOCKER_BASE_IMAGE to a local python:*-slim image)"
        )
    if os.geteuid() != 0:
        return "debootstrap needs root to make the base image (or set RS_DOCKER_BASE_IMAGE)"
    why = unreachable(MIRROR + "/dists/bookworm/Release")
    return f"the Debian mirror is unreachable, so no base image can be made: {why}" if why else None


def remove(directory: Path) -> None:
    """rm -rf `directory`, unmounting first whatever is mounted below it (dockerd's overlays, the
    proc and sys that an interrupted debootstrap leaves in its target), so that removing never
    reaches into a mounted file system."""
    prefix = str(directory.resolve()) + "/"
    with open("/proc/mounts") as mounts:
        ours = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for mount in sorted(ours, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open("/proc/mounts") as mounts:
        left = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    assert not left, f"could not unmount {left}; remove {directory} by hand"
    shutil.rmtree(directory, ignore_errors=True)


class Bootstrap:
    """One debootstrap run into a directory of its own, on a thread."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="rs-rootfs-", dir="/tmp"))
        self.rootfs = self.directory / "rootfs"
        self.skip: Optional[str] = None  # why no tree was made, when that is the environment's doing
        self.failure: Optional[str] = None  # debootstrap's own failure, with its output
        self._proc: Optional[subprocess.Popen] = None
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._make, name="debootstrap", daemon=True)
        self._thread.start()

    def _make(self) -> None:
        self.skip = why_not()
        if self.skip:
            return
        with self._lock:
            if self._stopped:
                return
            self._proc = subprocess.Popen(
                [*COMMAND, str(self.rootfs), MIRROR],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # its whole group is ended if the session stops first
            )
        try:
            output, _ = self._proc.communicate(timeout=_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._kill()
            output = f"(no end after {_TIMEOUT} s)"
        if self._proc.returncode != 0:
            self.failure = f"{' '.join(COMMAND)} exited {self._proc.returncode}:\n{output[-4000:]}"
        else:
            self._trim()

    def _trim(self) -> None:
        """What debootstrap leaves behind and no image needs."""
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            for path in (self.rootfs / leftover).glob("*"):
                if path.is_file() or path.is_symlink():
                    path.unlink()
                elif path.is_dir() and path.name != "partial":
                    shutil.rmtree(path)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def wait(self) -> Path:
        """The finished root file system; a skip saying why where none can be made here, an
        AssertionError with debootstrap's output where it failed."""
        self._thread.join(_TIMEOUT + 60)
        assert not self._thread.is_alive(), f"debootstrap still running after {_TIMEOUT + 60} s"
        if self.skip:
            pytest.skip(self.skip)
        assert self.failure is None, self.failure
        return self.rootfs

    def discard(self) -> None:
        """Stop debootstrap if it still runs and remove everything it made."""
        with self._lock:
            self._stopped = True
            self._kill()
        self._thread.join(30)
        remove(self.directory)


_started: List[Bootstrap] = []


def start() -> None:
    """Begin making the tree (once per session; nothing when RS_DOCKER_BASE_IMAGE names a base or
    this host has no Docker to use it with)."""
    if _started or os.environ.get("RS_DOCKER_BASE_IMAGE"):
        return
    if shutil.which("docker") is None:
        return
    _started.append(Bootstrap())


def take() -> Bootstrap:
    """The session's run (started now if collection did not start it): the caller owns it and
    discards it when done."""
    if not _started:
        _started.append(Bootstrap())
    return _started.pop()


def discard() -> None:
    """End and remove a run that no test took."""
    while _started:
        _started.pop().discard()
