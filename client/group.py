"""A group: a Communicator over some of the job's ranks, served by the same reducers through the
same engine as the job's Communicator, with its own ranks, world size and order of collectives.

The reducers learn a group's ranks from its members (a GROUP message before its first chunk)
and key its rounds by its id, so several groups of one job run side by side: torch's subgroups,
DeviceMesh dimensions, point-to-point pairs, Horovod's process sets.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from typing import Any, Sequence

from reduction_server.errors import CollectiveError

from .communicator import Communicator, Handle


def group_id(name: str) -> int:
    """The 64-bit id of the group named `name` (never 0: that is all of the job's ranks)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") or 1


class Group(Communicator):
    """The collectives of `ranks` (this rank among them) of `parent`'s job.

    Args:
        parent: the job's Communicator; its engine carries the group's chunks, and closing it
            ends the group too.
        ranks: the job's ranks in the group, in any order (the group's rank i is the i-th smallest).
        name: what identifies the group: the same on every member, different for every group of
            the job (torch's group name; two groups over the same ranks need two names: two
            open under one name count their collectives alike, and a collective started while
            another of the same seq is in flight fails, saying so).

    Raises:
        ValueError: ranks outside the job, or without this rank.
    """

    def __init__(self, parent: Communicator, ranks: Sequence[int], name: str) -> None:  # noqa: D107
        members = sorted({int(r) for r in ranks})
        if not members or members[0] < 0 or members[-1] >= parent.world_size:
            raise ValueError(f"a group's ranks must lie in 0..{parent.world_size - 1}, got {list(ranks)}")
        if parent.rank not in members:
            raise ValueError(f"rank {parent.rank} is not one of the group's ranks {members}")
        self.parent = parent
        self.ranks = tuple(members)
        self.group_id = group_id(name)
        self.name = name
        self.rank = members.index(parent.rank)
        self.world_size = len(members)
        self.reducers, self.job_id, self.generation = parent.reducers, parent.job_id, parent.generation
        self.active_reducers, self.active_endpoints = parent.active_reducers, parent.active_endpoints
        self.chunk_bytes, self.pipeline_depth = parent.chunk_bytes, parent.pipeline_depth
        self._seq = itertools.count()
        self._submit_lock = threading.Lock()
        self._engine = parent._engine
        self._buffers = parent._buffers
        self._closed = False
        self._engine.add_group(self.group_id, self.ranks)

    def _start(self, *args: Any, **kwargs: Any) -> Handle:
        if self._closed:
            raise CollectiveError(f"rank {self.parent.rank}: group {self.name!r} is closed")
        return super()._start(*args, **kwargs)

    def close(self) -> None:
        """The group takes no more collectives (those started end as they would); the engine
        stays its parent's."""
        if not self._closed:
            self._closed = True
            self._engine.remove_group(self.group_id)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, rank={self.rank} of ranks {list(self.ranks)})"
