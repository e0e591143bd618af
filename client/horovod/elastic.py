"""Horovod's elastic mode on this API: a training function that survives the loss of workers
and takes in new ones, as `hvd.elastic.run` documents it.

Under `reduction-server run --min-np A --max-np B` (reduction_server/launch/rendezvous.py) each worker
joins through the launcher's rendezvous: hvd.init() waits there for every live worker and gets
its rank, the world size and the round, which becomes the job's generation on the same
reducers. When a worker is lost, the others' collectives fail (HorovodInternalError): they roll
back to their last commit, initialize again without it, and go on. When the launcher adds a
worker, the next commit raises HostsUpdatedInterrupt on every rank alike (rank 0 asks the
rendezvous and tells the others); the ranks initialize again with the newcomer, which takes the
state from rank 0 (the oldest worker).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, List, Optional

from reduction_server.config import settings
from reduction_server.launch import rendezvous

from ..communicator import Communicator
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt

#: what a worker's launcher says of its place, which a round of an elastic job changes
_PLACEMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RS_RANK", "RS_WORLD_SIZE")
_joined_version: Optional[int] = None  # the rendezvous' membership version when this worker last joined


def enabled() -> bool:
    """Whether this worker belongs to an elastic job (the launcher set RS_RENDEZVOUS)."""
    return bool(settings.read("RS_RENDEZVOUS"))


def join() -> Communicator:
    """This worker's Communicator for the next round of the elastic job: its rank and size from
    the rendezvous, its generation the round's."""
    global _joined_version
    place = rendezvous.seat(
        settings.read("RS_RENDEZVOUS"), settings.read("RS_JOB_TOKEN"), settings.read("RS_WORKER_ID")
    )
    _joined_version = place.version
    # The launcher's placement variables describe the worker as it started; the round's replace them.
    environ = {k: v for k, v in os.environ.items() if k not in _PLACEMENT}
    environ.update(RS_RANK=str(place.rank), RS_WORLD_SIZE=str(place.size))
    return Communicator.from_env(environ, incarnation=place.round)


def hosts_updated() -> bool:
    """Whether workers were added or removed since this worker joined (asked of the rendezvous)."""
    if not enabled() or _joined_version is None:
        return False
    return rendezvous.version(settings.read("RS_RENDEZVOUS"), settings.read("RS_JOB_TOKEN")) > _joined_version


class State:
    """What a training function keeps across resets, as Horovod's State: commit() saves it (and
    checks for new hosts), restore() goes back to the last commit, sync() takes rank 0's.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (the framework's broadcast_object).
        get_rank: this worker's rank now.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call after each reset (a worker added or removed), e.g. to scale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a reset: reset() and every registered callback."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state, then raise HostsUpdatedInterrupt on every rank if workers were added
        or removed (rank 0 asks, every rank hears its answer)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """HostsUpdatedInterrupt on every rank alike if the job's workers changed."""
        if self._bcast_object(hosts_updated() if self._rank() == 0 else None):
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Keep the state as it is now."""
        raise NotImplementedError

    def restore(self) -> None:
        """Back to the last saved state."""
        raise NotImplementedError

    def sync(self) -> None:
        """Take rank 0's state."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before the state is synchronized."""


class ObjectState(State):
    """State of plain picklable objects, given as keyword arguments and kept as attributes."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        self._saved_state: Dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """`func(state, ...)` run again after each reset until it returns: a lost worker rolls the
    state back to its last commit; new workers take rank 0's state first."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            reset()
            state.on_reset()

    return wrapper
