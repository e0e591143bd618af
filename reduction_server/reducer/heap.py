"""A reducer's heap keeps the memory its messages free, for the next ones.

libzmq allocates a buffer of its own for every large message it receives and frees it once the
reducer has folded it in. glibc gives the free top of a heap back to the kernel (trimming, and
whole thread heaps deleted), so the next message's pages fault in again and are zeroed, in the
I/O thread, inside its copy from the socket: in a loopback job over tcp, half the page faults of
all its processes, and 3.5 % of the reducers' CPU (bench/RESULTS.md, "Changes that landed").
A reducer's memory is bounded anyway (RS_MAX_ACCUMULATOR_BYTES, each peer's window), so it keeps
its peak instead: its resident memory does not fall after a burst (docs/reliability.md, "Bounds").
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
#: glibc's largest mmap threshold on 64-bit hosts: a message up to it comes from a heap (a larger
#: chunk, RS_MAX_CHUNK_BYTES allowing, is still mapped and unmapped on its own)
_MMAP_THRESHOLD_MAX = 32 << 20
#: a thread heap's largest size: no heap shrinks, nor is one deleted, while less than this is free
_TOP_PAD = 64 << 20


def keep_freed_memory() -> bool:
    """Tell glibc's malloc never to give freed memory back to the kernel, and to take messages up
    to 32 MiB from its heaps; False where the C library has no mallopt (musl, macOS) or refused
    a setting (then the heap is left as glibc manages it)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # The mmap threshold first: on its own it changes nothing that the other two would need.
    if mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) != 1:
        return False
    return mallopt(_M_TOP_PAD, _TOP_PAD) == 1 and mallopt(_M_TRIM_THRESHOLD, -1) == 1
