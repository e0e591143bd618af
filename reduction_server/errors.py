"""The package's exceptions: one base class, one subclass per way things go wrong."""


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
