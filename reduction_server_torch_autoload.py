"""torch's entry point for the "reduction_server" backend (group `torch.backends`, setup.py).

torch calls `register` at the end of every `import torch` where this package is installed
(torch/__init__.py, `_import_device_backends`, torch 2.5 and later). It registers the backend's
name with a creator that imports `reduction_server.client.torch` only when torch creates the
backend: `init_process_group("reduction_server")` then works in a script, launcher or framework
that never imports this project, and a process that never asks for the backend gets nothing
else: no import of the package, no thread, no socket, no log line, torch's own env:// rendezvous
handler. (Rendezvous without MASTER_ADDR/MASTER_PORT, which a launcher sets, needs the explicit
`import reduction_server.client.torch`: torch meets the ranks before it creates the backend.)

Why a top-level module, beside the package rather than in it: importing any module of
`reduction_server` first runs `reduction_server/__init__.py` (NumPy, pyzmq, the wire protocol),
and torch turns any error while loading an entry point into a failed `import torch`. This one
imports only the standard library, and `register` catches everything: a broken install leaves
torch as it was, and every `import torch` pays well under a millisecond (bench/RESULTS.md,
"Self-registration: the cost of import torch").

Off with RS_TORCH_AUTOLOAD=0 (reduction_server/config/settings.py), or with torch's own
TORCH_DEVICE_BACKEND_AUTOLOAD=0, which calls no entry point at all.
"""

import os
import sys

BACKEND_NAME = "reduction_server"
#: the values that turn RS_TORCH_AUTOLOAD off: settings.read's for a switch (reading it through
#: the registry would import the package; tests/jobs/test_torch_autoload.py checks that they agree)
_OFF = ("0", "false", "no", "off")


def register() -> None:
    """Register the backend's name with torch.distributed and a creator that imports the adapter
    when first called; nothing if RS_TORCH_AUTOLOAD is off, torch has no torch.distributed, or the
    name is registered already. Never raises."""
    try:
        if os.environ.get("RS_TORCH_AUTOLOAD", "").strip().lower() in _OFF:
            return
        dist = sys.modules.get("torch.distributed")  # torch imports it before it calls entry points
        if dist is None:
            import torch.distributed as dist
        if not dist.is_available() or BACKEND_NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"])
    except Exception:  # noqa: BLE001 - whatever goes wrong, `import torch` must not fail because of it
        pass


def create_backend(options, backend_options=None):
    """The creator torch calls for "reduction_server": the adapter's (reduction_server.client.torch
    process_group.create_backend), imported now. A malformed RS_TORCH_AUTOLOAD is a ConfigError here,
    once the backend is asked for, never at `import torch`."""
    from reduction_server.config import settings

    settings.read("RS_TORCH_AUTOLOAD")
    from reduction_server.client.torch import create_backend as create

    return create(options, backend_options)
