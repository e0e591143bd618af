"""What user threads hand the engine thread: collectives to start, groups to announce or forget,
and the wish to close; a pipe wakes the thread, which polls it beside its sockets.

ZeroMQ sockets are not thread-safe, so user threads never touch them: they leave work here, under
a lock, and the engine thread takes it at the top of each turn of its loop.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from typing import Callable, Deque, Iterable, List, Optional, Sequence, Tuple

from reduction_server.errors import CollectiveError

from .collective import Collective


class Inbox:
    """The queue between user threads and one rank's engine thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)  # written under the lock: it must never block
        self.queue: Deque[Collective] = deque()
        self.groups: List[Tuple[int, Tuple[int, ...]]] = []  # to announce, before the queue's collectives
        # closed groups whose kept results (kept.py) go once none of their collectives is queued
        # or in flight: until then failover may still need them
        self.closed_groups: List[int] = []
        self.closing = False
        self.dead: Optional[str] = None  # why the engine stopped, once it has

    def put(self, coll: Collective, admit: Callable[[Collective], None]) -> None:
        """Queue coll for the engine thread, after `admit` (called under the lock); raises
        CollectiveError once the engine is closing or stopped."""
        with self.lock:
            self._refuse_if_closed(f"cannot start {coll.describe()}")
            admit(coll)
            self.queue.append(coll)
            self._wake()

    def add_group(self, group: int, ranks: Sequence[int]) -> None:
        """Announce `group` (ranks ascending) to the reducers before any of its chunks; raises
        CollectiveError once the engine is closing or stopped."""
        with self.lock:
            self._refuse_if_closed("cannot serve a new group")
            self.groups.append((group, tuple(ranks)))
            if group in self.closed_groups:  # made again: its results are kept again, under the same key
                self.closed_groups.remove(group)
            self._wake()

    def remove_group(self, group: int) -> None:
        """`group` takes no more collectives: the results kept for it can go once its last one ends."""
        with self.lock:
            if self.closing:  # the engine, and what it keeps, is gone or going
                return
            self.closed_groups.append(group)
            self._wake()

    def idle_closed_groups(self, active: Iterable[Collective]) -> List[int]:
        """The closed groups of which no collective is queued or `active` (the engine's, in
        flight), taken off the list: their kept results can go (called under the lock)."""
        if not self.closed_groups:
            return []
        busy = {coll.group for coll in itertools.chain(self.queue, active)}
        idle = [group for group in self.closed_groups if group not in busy]
        self.closed_groups = [group for group in self.closed_groups if group in busy]
        return idle

    def ask_to_close(self) -> bool:
        """Tell the engine thread to stop; False if it was told already."""
        with self.lock:
            if self.closing:
                return False
            self.closing = True
            self._wake()
            return True

    def woken(self) -> None:
        """The engine thread saw the pipe readable: empty it."""
        try:
            os.read(self.wake_fd, 4096)
        except BlockingIOError:
            pass

    def die(self, reason: str) -> List[Collective]:
        """The engine stopped for `reason`: refuse new collectives; returns those still queued."""
        with self.lock:
            self.dead = reason
            queued = list(self.queue)
            self.queue.clear()
        return queued

    def close(self) -> None:
        """Close the pipe, once no user thread can be writing to it."""
        with self.lock:
            os.close(self.wake_fd)
            os.close(self._wake_w)

    def _refuse_if_closed(self, what: str) -> None:
        """Raise CollectiveError saying `what` cannot be done, once the engine is closing or
        stopped (its pipe may be closed); called with the lock held."""
        if self.closing or self.dead:
            raise CollectiveError(f"rank {self.rank}: {what}: {self.dead or 'the communicator is closed'}")

    def _wake(self) -> None:
        """Wake the engine thread; called with the lock held. A full pipe wakes it already."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass
