"""Rendezvous without MASTER_ADDR: the env:// handler that gives this backend a process-local store.

With MASTER_ADDR/MASTER_PORT set, ``init_process_group`` works as for any backend (torchrun); where
RANK/WORLD_SIZE are unset, the launcher's own variables (mpirun's, srun's: the package's discovery)
give torch's handler the rank and world size.
Without them, the ``env://`` rendezvous takes rank and world size from the arguments,
RANK/WORLD_SIZE or the package's discovery (RS_RANK, CLUSTER_SPEC, TF_CONFIG, ...) and gives the
group a process-local store: this backend needs no store, and a backend that does (gloo) fails
with an error saying to set MASTER_ADDR/MASTER_PORT instead of hanging.
"""

import os
import sys
from datetime import timedelta
from typing import Any, Dict, List
from urllib.parse import parse_qs, urlencode, urlparse

import torch.distributed as dist

from reduction_server.config.discovery import discover_worker
from reduction_server.errors import ConfigError

from .process_group import BACKEND_NAME, create_backend


class _LocalStore(dist.Store):
    """The store of a job that has no rendezvous server: process-local keys. This backend never
    reads it; a backend that must meet its peers through it gets a clear error, not a hang."""

    #: no peer reads it (process_group.agreed_run_id asks)
    PROCESS_LOCAL = True

    def __init__(self) -> None:
        super().__init__()
        self._data: Dict[str, bytes] = {}

    def _missing(self, key: str) -> RuntimeError:
        return RuntimeError(
            f"no rendezvous store: init_process_group ran without MASTER_ADDR/MASTER_PORT, which only the "
            f"reduction_server backend can do (key {key!r} is another process's). Set MASTER_ADDR and "
            f"MASTER_PORT (or pass init_method/store) for gloo, nccl and new_group()"
        )

    def set(self, key, value) -> None:
        self._data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key) -> bytes:
        if key not in self._data:
            raise self._missing(key)
        return self._data[key]

    def add(self, key, value) -> int:
        current = int(self._data.get(key, b"0")) + int(value)
        self._data[key] = str(current).encode()
        return current

    def compare_set(self, key, expected, desired) -> bytes:
        current = self._data.get(key)
        if (current is None and not expected) or current == expected:
            self._data[key] = desired
            return desired
        return current if current is not None else expected

    def check(self, keys) -> bool:
        return all(k in self._data for k in keys)

    def wait(self, keys, timeout=None) -> None:
        for key in keys:
            if key not in self._data:
                raise self._missing(key)

    def delete_key(self, key) -> bool:
        return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._data)

    def set_timeout(self, timeout) -> None:
        pass


_env_handler = None
_stores: List[_LocalStore] = []


def _env_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any):
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        yield from _env_handler(_placed(url, query), timeout=timeout, **kwargs)
        return
    place = _discovered()
    if place is None and not os.environ.get("RS_REDUCERS"):
        yield from _env_handler(url, timeout=timeout, **kwargs)  # not a reduction_server job: torch's error
        return
    rank = int(query.get("rank", os.environ.get("RANK") or (place.rank if place else -1)))
    world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE") or (place.world_size if place else -1)))
    if rank < 0 or world_size < 1:
        raise ValueError(
            "init_process_group: no rank and world size (pass rank= and world_size=, or set "
            "RS_RANK/RS_WORLD_SIZE or RANK/WORLD_SIZE)"
        )
    store = _LocalStore()
    _stores.append(store)  # the Python object must outlive torch's C++ references to it
    yield store, rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


def _discovered() -> Any:
    """The package's discovery of this worker's place, None where it finds none."""
    try:
        return discover_worker()
    except ConfigError:
        return None


def _placed(url: str, query: Dict[str, str]) -> str:
    """`url` with the rank and world size that torch's env:// handler would not find (it reads only
    RANK and WORLD_SIZE) but the launcher gave (mpirun, srun, PMI: discovery's place), in its query."""
    missing = [
        (key, attribute)
        for key, variable, attribute in (("rank", "RANK", "rank"), ("world_size", "WORLD_SIZE", "world_size"))
        if key not in query and not os.environ.get(variable)
    ]
    place = _discovered() if missing else None
    if place is None:
        return url
    return url + ("&" if "?" in url else "?") + urlencode({key: getattr(place, a) for key, a in missing})


def register() -> None:
    """Register the backend with torch, and the env:// handler that needs no MASTER_ADDR (idempotent).
    Where `import torch` registered the backend already (the installed package's `torch.backends`
    entry point, reduction_server_torch_autoload.py), its creator stays: it calls create_backend."""
    global _env_handler
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"])
    rdzv = sys.modules["torch.distributed.rendezvous"]  # the module (its package re-exports a function)
    handler = rdzv._rendezvous_handlers.get("env")
    if handler is not None and handler is not _env_rendezvous:
        _env_handler = handler
        rdzv._rendezvous_handlers["env"] = _env_rendezvous
