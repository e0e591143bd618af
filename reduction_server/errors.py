"""The package's exceptions: one base class, one subclass per way things go wrong."""

import errno


class ReductionServerError(Exception):
    """Base of every error this package raises."""


class ConfigError(ReductionServerError, ValueError):
    """Missing, malformed or contradictory configuration; the message names the variable."""


class ProtocolError(ReductionServerError):
    """A frame that does not follow the wire protocol (bad magic, version, size, field)."""


class CollectiveError(ReductionServerError, RuntimeError):
    """A collective that cannot complete; the message names the rank, reducer and collective."""


class ListenError(ReductionServerError, OSError):
    """A reducer cannot listen where it was told (a busy port, an address not of this host)."""

    @classmethod
    def binding(cls, host: str, port: int, code: int, detail: str, shard: int = 0) -> "ListenError":
        """Why binding `host`:`port` (0: any port) failed with errno `code`, in one line that says
        what to do; `shard` s > 0: the port is shard s's, --port + s."""
        where = f"tcp://{f'[{host}]' if ':' in host else host}:{port or '*'}"
        if shard:
            where += f", shard {shard}'s port (--port + {shard})"
        if code == errno.EADDRINUSE:
            return cls(
                f"cannot listen on {where}: the port is already in use (another reducer or program "
                "listens there); stop it, or choose another port (--port; 0 picks a free one)"
            )
        if code == errno.EADDRNOTAVAIL:
            return cls(
                f"cannot listen on {where}: {host} is not an address of this host "
                "(--host / RS_BIND_HOST; 0.0.0.0 listens on all of them)"
            )
        return cls(f"cannot listen on {where}: {detail}")
