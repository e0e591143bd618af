"""The elastic job's rendezvous: which workers form the job now, and each one's rank in it.

`reduction-server run --min-np A --max-np B` serves it (HTTP on the launcher's host) for elastic
Horovod (client/horovod/elastic.py). Every worker has an id (RS_WORKER_ID) for its whole life;
the launcher adds the ids of the workers it starts and removes those of workers that fail. A
worker that (re)initializes asks to join (POST /join): the answer waits until every live worker
has asked, then gives each its rank (live ids in ascending order: the oldest worker is rank 0,
and holds the state newcomers sync from), the world size, and the round: a generation number
every member of the round shares, so the reducers take the round for a new generation of the
job. POST /version says how often the membership changed: a worker whose round is older learns
at its next commit that workers were added or removed.

Every request proves the job token, fresh and once (rendezvous_proof.py), and every answer to it
is proved for that request; a request without the right proof is refused and changes nothing. What
a peer that has not proved the token can make the server hold is bounded (rendezvous_server.py).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..errors import CollectiveError
from . import rendezvous_proof
from .rendezvous_server import MAX_UNPROVED, READ_TIMEOUT_S, Server

#: how long a join waits for the other live workers before it fails
JOIN_TIMEOUT_S = 120.0
#: characters of an unproved refusal's reason that a worker repeats
_REASON_CHARS = 300
#: tries of a request whose connection closes before any answer, the first wait between them
#: (doubling: 5 tries wait 1.5 s in all)
_ATTEMPTS, _RETRY_S = 5, 0.1


@dataclass(frozen=True)
class Seat:
    """A worker's place in one round: its rank, the world size, and the round (a generation)."""

    rank: int
    size: int
    round: int
    version: int = field(default=0, compare=False)  # the membership's version the round was formed from


class Rendezvous:
    """The membership (live worker ids), its version, and the rounds formed from it."""

    def __init__(
        self,
        token: str,
        host: str = "127.0.0.1",
        join_timeout: float = JOIN_TIMEOUT_S,
        on_round: Optional[Callable[[int, List[int]], None]] = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_unproved: int = MAX_UNPROVED,
    ) -> None:
        self.token = token
        self.on_round = on_round  # told each round formed: its number, and the worker ids by rank
        self.join_timeout = join_timeout
        self.members: Set[int] = set()
        self.version = 0  # membership changes so far
        self.round = 0  # rounds formed so far
        self.seats: Dict[int, Seat] = {}  # answers of the round formed last, by worker id
        self.asking: Set[int] = set()  # ids waiting for the next round
        self.changed = threading.Condition()
        self.server = Server(host, self, read_timeout_s, max_unproved)
        self.thread = threading.Thread(target=self.server.serve_forever, name="rendezvous", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> "Rendezvous":
        self.thread.start()
        return self

    def close(self) -> None:
        with self.changed:
            self.members.clear()
            self.changed.notify_all()  # waiting joins end (their workers are being stopped)
        self.server.shutdown()
        self.server.server_close()

    # -- the launcher's side -----------------------------------------------------------------
    def add(self, worker: int) -> None:
        """A worker started: it belongs to the next round."""
        with self.changed:
            self.members.add(worker)
            self.version += 1
            self._form()

    def remove(self, worker: int) -> None:
        """A worker failed: the next round goes on without it."""
        with self.changed:
            self.members.discard(worker)
            self.asking.discard(worker)
            self.version += 1
            self._form()

    # -- the workers' side ---------------------------------------------------------------------
    def join(self, worker: int) -> Seat:
        """Wait for the round that every live worker asked for; this worker's seat in it."""
        with self.changed:
            if worker not in self.members:
                raise PermissionError(f"worker {worker} is not a member of this job (it failed, or was never started)")
            self.asking.add(worker)
            asked_at = self.round
            self._form()
            if not self.changed.wait_for(
                lambda: self.round > asked_at or worker not in self.members, self.join_timeout
            ):
                missing = sorted(self.members - self.asking)
                self.asking.discard(worker)
                raise TimeoutError(f"workers {missing} did not rejoin within {self.join_timeout:g} s")
            if worker not in self.seats:
                raise PermissionError(f"worker {worker} left the job while it waited")
            return self.seats[worker]

    def answer(self, path: str, body: bytes) -> Tuple[int, Dict[str, Any]]:
        """The status and document answering a request that proved the token."""
        try:
            request = json.loads(body)
            if path == "/join":
                seat = self.join(int(request["worker"]))
                return 200, {"rank": seat.rank, "size": seat.size, "round": seat.round, "version": seat.version}
            if path == "/version":
                return 200, {"version": self.version}
            return 404, {"error": f"no such request: {path}"}
        except (ValueError, KeyError, TypeError) as exc:
            return 400, {"error": f"malformed request: {exc}"}
        except (PermissionError, TimeoutError) as exc:
            return 409, {"error": str(exc)}

    def _form(self) -> None:
        """With the lock held: once every live member asks, the next round forms."""
        if not self.members or not self.members <= self.asking:
            return
        ranked: List[int] = sorted(self.members)
        self.round += 1
        self.seats = {worker: Seat(rank, len(ranked), self.round, self.version) for rank, worker in enumerate(ranked)}
        self.asking -= self.members
        self.changed.notify_all()
        if self.on_round is not None:
            self.on_round(self.round, ranked)


def ask(address: str, token: str, path: str, document: dict, timeout: float = JOIN_TIMEOUT_S + 10) -> dict:
    """A worker's request to the rendezvous at `address`; its answer, proved by the same token for
    this request. CollectiveError naming the rendezvous and the reason when it refuses or cannot
    be reached."""
    body = json.dumps(document).encode()
    for attempt in range(_ATTEMPTS):
        proof = rendezvous_proof.sign(token, path, body)  # a fresh nonce each time: a proof is used once
        request = urllib.request.Request(
            f"http://{address}{path}",
            data=body,
            method="POST",
            headers={rendezvous_proof.HEADER: proof.header(), "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer, status = response.read(), response.status
                signed = response.headers.get(rendezvous_proof.HEADER)
            break
        except urllib.error.HTTPError as exc:
            answer, status, signed = exc.read(), exc.code, exc.headers.get(rendezvous_proof.HEADER)
            break
        except OSError as exc:
            # Closed before any answer: the rendezvous not listening yet, or a connection it closed
            # unread because strangers filled its bound; nothing was done, so ask again.
            if attempt + 1 == _ATTEMPTS or not isinstance(getattr(exc, "reason", exc), ConnectionError):
                raise CollectiveError(
                    f"the elastic rendezvous at {address} (RS_RENDEZVOUS) cannot be reached: {exc}"
                ) from None
            time.sleep(_RETRY_S * 2**attempt)
    if signed is None and status != 200:  # a refusal before the proof: it proves nothing, and says why
        raise CollectiveError(f"the elastic rendezvous at {address} refused {path}: {_reason(answer)}")
    if not rendezvous_proof.answer_proves(token, proof.nonce, status, answer, signed):
        raise CollectiveError(
            f"the elastic rendezvous at {address} did not prove the job token (RS_JOB_TOKEN): "
            "its token is not this worker's"
        )
    result = json.loads(answer)
    if status != 200:
        raise CollectiveError(f"the elastic rendezvous at {address} refused {path}: {result.get('error')}")
    return result


def _reason(answer: bytes) -> str:
    """The reason an unproved refusal gives, shortened: whoever sent it has proved nothing."""
    try:
        reason = str(json.loads(answer)["error"])
    except (ValueError, KeyError, TypeError):
        reason = answer.decode("utf-8", "replace")
    return reason[:_REASON_CHARS]


def seat(address: str, token: str, worker: int) -> Seat:
    """This worker's seat in the next round (waits for the other live workers)."""
    answer = ask(address, token, "/join", {"worker": worker})
    return Seat(answer["rank"], answer["size"], answer["round"], answer["version"])


def version(address: str, token: str) -> int:
    """How often the membership has changed."""
    return int(ask(address, token, "/version", {}, timeout=10)["version"])


__all__ = ["JOIN_TIMEOUT_S", "Rendezvous", "Seat", "ask", "seat", "version"]
