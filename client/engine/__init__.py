"""The progress engine of a worker: one background thread that owns its sockets and moves chunks.

Each concept is a room (a module of this package); the rooms, in the order they may import each
other, are mapped in docs/design.md, "Where each concept lives".
"""

from .collective import Collective
from .connections import RECONNECT_S
from .engine import Engine
from .handshake import WAITING_REPORT_S

__all__ = ["Collective", "Engine", "RECONNECT_S", "WAITING_REPORT_S"]
