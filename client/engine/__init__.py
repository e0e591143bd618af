"""The progress engine of a worker: one background thread that owns its sockets and moves chunks.

Rooms (each a module), in the order they may import each other:
- identity.py: who the worker is (rank, world, job, generation), as its headers say it;
- collective.py: one collective in flight, its chunk plan (chunking.py) and each chunk's state;
- ledger.py: the collectives in flight, and every way one ends;
- slots.py: shared-memory slots with reducers on this host;
- kept.py: the results kept for failover, in slots, messages, views of collectives or buffers of their own;
- failover.py: the reducers lost, where each chunk goes now, what to resend;
- watch.py: what each connection's monitor says: how far its handshake got, failed security handshakes;
- connections.py: a socket per reducer, one connection each, lost and opened again;
- handshake.py: the proofs of the job token both ways, and the first wait for every reducer;
- pump.py: chunks out in one global order within each reducer's window;
- results.py: everything reducers send back, settled against the chunks it answers;
- inbox.py: what user threads hand the engine thread (collectives, groups, closing), and its wake-up pipe;
- engine.py: `Engine`, the thread and its loop, and the user side (start, submit, close).
"""
from .collective import Collective
from .connections import RECONNECT_S
from .engine import Engine
from .handshake import WAITING_REPORT_S

__all__ = ["Collective", "Engine", "RECONNECT_S", "WAITING_REPORT_S"]
