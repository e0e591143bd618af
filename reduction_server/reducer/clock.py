"""The reducer loop's idea of now: set once per loop turn, read by every room (and set by tests
that drive a reducer through time)."""


class Clock:
    """A monotonic time in seconds, as of the loop's current turn."""

    now = 0.0
