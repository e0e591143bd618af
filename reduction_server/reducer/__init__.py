"""The reducer: one process that receives chunk contributions from W workers over one ROUTER
socket, sums each key's, and sends the sum back to every rank.

Each concept is a room (a module of this package); the rooms, in the order they may import each
other, are mapped in docs/design.md, "Where each concept lives".
"""

from .admission import FORGET_AFTER_S, MAX_STRIKE_ENTRIES, MAX_STRIKES
from .core import PROBE_DELAYS, Reducer
from .membership import Peer
from .outbox import MAX_ERROR_TEXT
from .process import serve
from .rounds import MAX_FAILED_ROUNDS, RETAIN_FAILED_S

__all__ = [
    "FORGET_AFTER_S",
    "MAX_ERROR_TEXT",
    "MAX_FAILED_ROUNDS",
    "MAX_STRIKES",
    "MAX_STRIKE_ENTRIES",
    "PROBE_DELAYS",
    "Peer",
    "RETAIN_FAILED_S",
    "Reducer",
    "serve",
]
