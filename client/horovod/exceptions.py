"""Horovod's exceptions, as its scripts catch them."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from reduction_server.errors import CollectiveError


class HorovodInternalError(CollectiveError):
    """A collective failed (a rank or reducer was lost, the ranks disagreed on a tensor, the job
    shut down): what Horovod raises from synchronize(), and what its elastic mode recovers from."""


class MismatchError(CollectiveError):
    """A named collective the ranks asked for in ways that cannot run together (its kind, dtype,
    op, root or shape differ, or a joined rank cannot stand in for it): what Horovod's ops fail
    with FAILED_PRECONDITION. Raised as HorovodInternalError (the TensorFlow API: a subclass that
    is also tf.errors.FailedPreconditionError)."""


class HostsUpdatedInterrupt(RuntimeError):
    """The job's hosts changed: Horovod's elastic mode stops the step to take them in."""

    def __init__(self, skip_sync: bool = False) -> None:  # noqa: D107
        super().__init__("the job's hosts were updated")
        self.skip_sync = skip_sync


@contextmanager
def as_horovod_errors() -> Iterator[None]:
    """A collective that fails inside raises HorovodInternalError (its message kept), as
    Horovod's do; anything else (a bad argument) goes through as it is."""
    try:
        yield
    except HorovodInternalError:
        raise
    except CollectiveError as error:
        raise HorovodInternalError(str(error)) from error
