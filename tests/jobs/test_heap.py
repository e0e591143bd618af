"""A reducer keeps the memory its messages free (reduction_server/reducer/heap.py): large buffers freed
and allocated again are not faulted in again. Each case runs in a fresh interpreter, since the
setting holds for the whole process, with glibc's own environment variables left out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")

#: 12 chunks of 8 MiB at once: more than one 64 MiB thread heap, more than glibc's top pad
_CHUNKS, _CHUNK_BYTES, _STEPS, _WARMUP = 12, 8 << 20, 6, 2

_CYCLES = f"""
import ctypes, resource, sys, threading
from reduction_server.reducer import heap
libc = ctypes.CDLL(None)
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: huge pages would hide the faults either way
if sys.argv[1] == "kept" and not heap.keep_freed_memory():
    sys.exit(3)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
faults = []

def receive():
    for step in range({_STEPS}):  # a window of chunks received, folded, freed
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        chunks = [libc.malloc({_CHUNK_BYTES}) for _ in range({_CHUNKS})]
        for p in chunks:
            ctypes.memset(p, 1, {_CHUNK_BYTES})  # as the socket's data is copied in
        for p in chunks:
            libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

# in a thread of its own, as libzmq's I/O thread (a heap of its own, not the main one), or not
thread = threading.Thread(target=receive) if sys.argv[2] == "thread" else None
receive() if thread is None else (thread.start(), thread.join())
print(sum(faults[{_WARMUP}:]))
"""


def _faults_after_warming_up(mode: str, where: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run(
        [sys.executable, "-c", _CYCLES, mode, where], capture_output=True, text=True, timeout=60, env=env
    )
    if done.returncode == 3:
        pytest.skip("this C library has no mallopt, or refused the settings (not glibc)")
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.parametrize("where", ["thread", "main"])
def test_memory_freed_is_allocated_again_without_faulting_in_its_pages(where: str):
    pages = (_STEPS - _WARMUP) * _CHUNKS * _CHUNK_BYTES // 4096
    assert _faults_after_warming_up("kept", where) < pages // 50
    # glibc by default gives a window's memory back once it is freed: the control shows this case can fail
    assert _faults_after_warming_up("default", where) > pages // 5
