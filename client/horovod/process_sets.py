"""Horovod's process sets: collectives among some of the job's ranks.

A process set is a group on the reducers (client/group.py): its members' collectives are keyed by
its own id and numbered on their own, so several sets run side by side with the global one. Each
set its rank belongs to has a Coordinator of its own (named collectives matched among its
members). Adding and removing a set are collectives of every rank, as with Horovod's dynamic
process sets; ids count up from 1 in the order the sets were added, the same on every rank.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..communicator import Communicator
from ..group import Group
from .coordinator import Coordinator


class ProcessSet:
    """Some of the job's ranks. Pass one to hvd.add_process_set() (or hvd.init(process_sets=))
    and then as `process_set=` to any collective; `process_set_id` is set once it is added."""

    process_set_id: Optional[int] = None
    ranks: Optional[list] = None
    _rank: Optional[int] = None  # this process's rank in the job, once the set is added

    def __init__(self, ranks: Sequence[int]) -> None:  # noqa: D107
        try:
            members = sorted(ranks)
        except TypeError:
            raise ValueError(
                f"a ProcessSet takes a list of ranks, got {ranks!r} (mpi4py communicators are not "
                "supported: the reduction server runs without MPI)"
            ) from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in members):
            raise ValueError(f"a ProcessSet's ranks must be integers, got {list(ranks)!r}")
        self.ranks = members

    def size(self) -> Optional[int]:
        """How many ranks the set has (None until it is added)."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (None until added, or when it is not a member);
        collectives still take global ranks as their root."""
        if self.process_set_id is None or self._rank not in self.ranks:
            return None
        return self.ranks.index(self._rank)

    def included(self) -> Optional[bool]:
        """Whether this process is one of the set's ranks (None until the set is added)."""
        return None if self.process_set_id is None else self._rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


#: every rank of the job; its ranks are filled in by hvd.init()
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class ProcessSets:
    """This process's table of the job's process sets: the ranks of each, and a Coordinator for
    each set this rank is in."""

    def __init__(self, comm: Communicator, world: Coordinator, prefix: str) -> None:  # noqa: D107
        self.comm = comm
        self.world = world
        self.prefix = prefix  # this init's: its groups never reuse the keys of an earlier init's
        everyone = tuple(range(comm.world_size))
        self._sets: Dict[int, Tuple[Tuple[int, ...], Optional[Coordinator]]] = {0: (everyone, world)}
        self._next_id = 1
        global_process_set.ranks = list(range(comm.world_size))
        global_process_set._rank = comm.rank

    def add(self, ranks: Sequence[int]) -> int:
        """Register `ranks` as the next set (every rank calls it with the same ranks); its id."""
        members = tuple(ranks)
        if not members or members[0] < 0 or members[-1] >= self.comm.world_size:
            raise ValueError(f"a process set's ranks must lie in 0..{self.comm.world_size - 1}, got {list(members)}")
        if len(set(members)) != len(members):
            raise ValueError(f"a process set's ranks must differ, got {list(members)}")
        if any(known == members for known, _ in self._sets.values()):
            raise ValueError(f"Attempted to add a duplicate process set: ranks {list(members)} already form one")
        set_id = self._next_id
        self._next_id += 1
        coordinator = None
        if self.comm.rank in members:
            group = Group(self.comm, members, f"{self.prefix}.process_set.{set_id}")
            coordinator = Coordinator(group, owns_communicator=False, marks_cycles=False)
        self._sets[set_id] = (members, coordinator)
        return set_id

    def remove(self, set_id: int) -> bool:
        """Forget a set (every rank calls it); False if there is no such set or it is the global one."""
        if set_id == 0 or set_id not in self._sets:
            return False
        _, coordinator = self._sets.pop(set_id)
        if coordinator is not None:
            coordinator.shutdown()
            coordinator.comm.close()
        return True

    def ranks(self, set_id: int) -> Tuple[int, ...]:
        """The ranks of set `set_id`."""
        return self._lookup(set_id)[0]

    def coordinator(self, process_set: Any) -> Coordinator:
        """The Coordinator of `process_set` (None or the global set: every rank's); ValueError
        when the set is unknown or this rank is not one of its members."""
        set_id = 0 if process_set is None else process_set.process_set_id
        ranks, coordinator = self._lookup(set_id)
        if coordinator is None:
            raise ValueError(
                f"rank {self.comm.rank} is not in process set {set_id} (ranks {list(ranks)}); only its "
                "members may run its collectives"
            )
        return coordinator

    def root(self, process_set: Any, root_rank: int) -> int:
        """The position within `process_set` of the global rank `root_rank`."""
        ranks = self.ranks(0 if process_set is None else process_set.process_set_id)
        if root_rank not in ranks:
            raise ValueError(f"root rank {root_rank} is not in the process set's ranks {list(ranks)}")
        return ranks.index(root_rank)

    def shutdown(self) -> None:
        """End every set's collectives, then the global ones."""
        for set_id in sorted(self._sets, reverse=True):
            if set_id:
                self.remove(set_id)
        self.world.shutdown()

    def _lookup(self, set_id: Optional[int]) -> Tuple[Tuple[int, ...], Optional[Coordinator]]:
        if set_id not in self._sets:
            raise ValueError(
                f"process set {set_id} is not registered (add it with hvd.add_process_set() on "
                "every rank first; a removed set cannot be used again)"
            )
        return self._sets[set_id]


ProcessSetLike = Union[ProcessSet, Sequence[int]]
