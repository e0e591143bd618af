"""A reducer keeps the memory its messages free (reduction_server/heap.py): a large buffer freed
and allocated again is not faulted in again. Each case runs in a fresh interpreter, since the
setting holds for the whole process."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")

_CYCLES = """
import ctypes, resource, sys, threading
from reduction_server import heap
if sys.argv[1] == "kept" and not heap.keep_freed_memory():
    sys.exit(3)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 8 << 20  # a chunk, as libzmq allocates one per large message
faults = []

def receive():
    for step in range(6):  # a window of four chunks received, folded, freed
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        chunks = [libc.malloc(size) for _ in range(4)]
        for p in chunks:
            ctypes.memset(p, 1, size)  # as the socket's data is copied in
        for p in chunks:
            libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

# in a thread of its own, as libzmq's I/O thread (a heap of its own, not the main one)
thread = threading.Thread(target=receive) if sys.argv[2] == "thread" else None
receive() if thread is None else (thread.start(), thread.join())
print(sum(faults[2:]))
"""


def _faults_after_warming_up(mode: str, where: str) -> int:
    done = subprocess.run([sys.executable, "-c", _CYCLES, mode, where], capture_output=True, text=True, timeout=60)
    if done.returncode == 3:
        pytest.skip("the C library has no mallopt (not glibc)")
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.parametrize("where", ["thread", "main"])
def test_memory_freed_is_allocated_again_without_faulting_in_its_pages(where: str):
    pages = 4 * 4 * (8 << 20) // 4096  # the four steps after the first two
    assert _faults_after_warming_up("kept", where) < pages // 50
    # glibc by default gives a window's memory back once it is freed: the control shows this case can fail
    assert _faults_after_warming_up("default", where) > pages // 5
