"""Poly1305 from OpenSSL's libcrypto, the one this Python's hashlib is linked with, through
ctypes: OpenSSL's vectorised code (about 0.2 CPU-s per GiB), and the GIL released during each
call (ctypes releases it around every foreign call), so that a large payload's tag never holds up
the process's other threads. The `cryptography` package has the same code, but holds the GIL
while it runs (measured: a 512 MiB update left a spinning thread 3 % of its rate).

Poly1305 is a one-time authenticator: each key may tag one message only (integrity.py derives
one per message).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib  # noqa: F401 - loads _hashlib, and with it the libcrypto looked for below
import threading
from typing import Optional, Sequence, Union

import numpy as np

KEY_BYTES = 32
TAG_BYTES = 16
Buffer = Union[bytes, bytearray, memoryview]


def _library_path() -> Optional[str]:
    """The libcrypto this process has loaded (hashlib's), else the system's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcrypto" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("crypto")


def _bind() -> tuple:
    """(libcrypto, its POLY1305 EVP_MAC), or raise OSError saying why there is none."""
    path = _library_path()
    if path is None:
        raise OSError("no OpenSSL libcrypto found (hashlib's, or the system's)")
    lib = ctypes.CDLL(path)
    try:
        fetch = lib.EVP_MAC_fetch
    except AttributeError:
        raise OSError(f"{path} is older than OpenSSL 3.0 (it has no EVP_MAC)") from None
    fetch.restype, fetch.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    lib.EVP_MAC_CTX_new.restype, lib.EVP_MAC_CTX_new.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    lib.EVP_MAC_CTX_free.restype, lib.EVP_MAC_CTX_free.argtypes = None, [ctypes.c_void_p]
    lib.EVP_MAC_init.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.EVP_MAC_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.EVP_MAC_final.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_size_t,
    ]
    mac = fetch(None, b"POLY1305", None)
    if not mac:
        raise OSError(f"{path} offers no POLY1305 MAC")
    return lib, mac


try:
    _LIB, _MAC = _bind()
    UNAVAILABLE: Optional[str] = None
except OSError as exc:
    _LIB = _MAC = None
    UNAVAILABLE = str(exc)


class _Context:
    """One EVP_MAC_CTX, re-keyed for each message; one per thread (a context is not thread-safe)."""

    def __init__(self) -> None:
        self.ctx = _LIB.EVP_MAC_CTX_new(_MAC)
        if not self.ctx:
            raise MemoryError("EVP_MAC_CTX_new failed")
        self.out = ctypes.create_string_buffer(TAG_BYTES)
        self.size = ctypes.c_size_t()
        self.free = _LIB.EVP_MAC_CTX_free  # held here: at exit the module's globals may be gone first

    def __del__(self) -> None:
        self.free(self.ctx)


_contexts = threading.local()


def tag(key: bytes, parts: Sequence[Buffer]) -> bytes:
    """The Poly1305 tag of the parts' bytes, one after the other, under a one-time `key` (32 bytes)."""
    context = getattr(_contexts, "context", None)
    if context is None:
        if UNAVAILABLE is not None:
            raise RuntimeError(f"Poly1305 is unavailable: {UNAVAILABLE}")
        context = _contexts.context = _Context()
    ctx, lib = context.ctx, _LIB
    ok = lib.EVP_MAC_init(ctx, key, KEY_BYTES, None)
    for part in parts:
        if isinstance(part, bytes):
            ok &= lib.EVP_MAC_update(ctx, part, len(part))
            continue
        data = np.frombuffer(part, np.uint8)  # its bytes, whatever its format (read-only ones too)
        if data.size:
            ok &= lib.EVP_MAC_update(ctx, data.__array_interface__["data"][0], data.size)
    ok &= lib.EVP_MAC_final(ctx, context.out, ctypes.byref(context.size), TAG_BYTES)
    if ok != 1:
        raise RuntimeError("OpenSSL's Poly1305 failed")
    return context.out.raw
