"""The reducer: receive chunk contributions from W workers, sum them, send the sum back.

One ROUTER socket; every worker connects a DEALER to it. A worker is admitted by the handshake;
then each DATA message is one rank's contribution to one key (job, generation, seq, chunk),
folded into that key's accumulator; when all W ranks have contributed, the result goes back to
every rank. A worker on the reducer's own host may send its chunks through shared-memory slots
(shared_memory.py). Each concept has its room:

- core.py: `Reducer`, the socket and its event loop, each message handed to its room;
- admission.py: the handshake and the job token both ways, the job served, strangers;
- membership.py: the admitted ranks, their heartbeats, their loss, their groups;
- rejoin.py: from which collective of each group workers that lost this reducer use it again;
- rounds.py: the state of each key and its transitions (open, complete, failed, forgotten);
- fold.py: loading and folding contributions, finishing results, the memory that takes;
- delivery.py: results to the ranks (slots or one frame), and the bytes sent;
- finals.py: moved rounds settled by a result a rank brought from a lost reducer (FINAL);
- clock.py: the loop's idea of now;
- outbox.py: every send, non-blocking, with its failure accounting;
- process.py: `serve`, from configuration and binding to the stop summary.

Each room imports only those below it in this order: clock, outbox, rejoin, membership, fold, delivery,
finals, rounds, admission, core, process.
"""
from .admission import FORGET_AFTER_S, MAX_STRIKE_ENTRIES, MAX_STRIKES
from .core import PROBE_DELAYS, Reducer
from .membership import Peer
from .outbox import MAX_ERROR_TEXT
from .process import serve
from .rounds import MAX_FAILED_ROUNDS, RETAIN_FAILED_S

__all__ = ["FORGET_AFTER_S", "MAX_ERROR_TEXT", "MAX_FAILED_ROUNDS", "MAX_STRIKES", "MAX_STRIKE_ENTRIES",
           "PROBE_DELAYS", "Peer", "RETAIN_FAILED_S", "Reducer", "serve"]
