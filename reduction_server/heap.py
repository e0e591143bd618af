"""A reducer's heap keeps the memory its messages free, for the next ones.

libzmq allocates a buffer of its own for every large message it receives and frees it once the
reducer has folded it in. glibc gives the free top of a heap back to the kernel (trimming, and
whole thread heaps deleted), so the next message's pages fault in again and are zeroed, in the
I/O thread, inside its copy from the socket: in a loopback job over tcp, half the page faults of
all its processes, and 3.5 % of the reducers' CPU (bench/RESULTS.md, "Changes that landed"). A reducer's memory is bounded anyway
(RS_MAX_ACCUMULATOR_BYTES, each peer's window), so it keeps its peak instead.
"""
from __future__ import annotations

import ctypes

from .log import get_logger

log = get_logger("reducer")

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
#: glibc's largest mmap threshold on 64-bit hosts: chunks up to it come from a heap, not mmap
_MMAP_THRESHOLD_MAX = 32 << 20
#: a thread heap's largest size: a heap never shrinks, nor is it deleted, while this much is free
_TOP_PAD = 64 << 20


def keep_freed_memory() -> bool:
    """Tell glibc's malloc never to give freed memory back to the kernel, nor to map a message
    of its own; False, and nothing done, where the C library is not glibc (musl, macOS)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: the heap is left as it is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_TRIM_THRESHOLD, -1), (_M_TOP_PAD, _TOP_PAD), (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)))
