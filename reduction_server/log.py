"""Structured logging: one line per event, `event key=value ...`, quiet by default.

RS_LOG_LEVEL (DEBUG, INFO, NOTICE, WARNING, ERROR; default NOTICE) sets the level of every
logger under `reduction_server`. NOTICE, between INFO and WARNING, is for the few lines an
operator wants from a healthy process: a reducer's configuration at start and its summary at
stop. Per-peer and per-round events are INFO or DEBUG; problems are WARNING or ERROR.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from .config import settings

_configured = False
NOTICE = 25
#: seconds between two lines of one cause that a peer without the job token can make a process log
THROTTLE_S = 10.0
#: causes a Throttle keeps at once; past it, the oldest interval ends early (with its summary)
MAX_THROTTLED_CAUSES = 256
logging.addLevelName(NOTICE, "NOTICE")


def _quote(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def get_logger(name: str) -> logging.Logger:
    """A logger under `reduction_server`, configured from RS_LOG_LEVEL on first use."""
    global _configured
    if not _configured:
        _configured = True
        root = logging.getLogger("reduction_server")
        level = settings.read("RS_LOG_LEVEL").upper()
        root.setLevel(logging.getLevelName(level) if level in settings.LOG_LEVELS else NOTICE)
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
            root.addHandler(handler)
        root.propagate = False
        if level not in settings.LOG_LEVELS:  # loggers are made at import: a clear line, not an exception there
            root.warning("RS_LOG_LEVEL=%r is not one of %s; logging at NOTICE", level, ", ".join(settings.LOG_LEVELS))
    return logging.getLogger(f"reduction_server.{name}")


def event(logger: logging.Logger, level: int, name: str, **fields: Any) -> None:
    """Log `name k=v k=v`; the fields are only formatted when the level is enabled."""
    if logger.isEnabledFor(level):
        logger.log(level, "%s %s", name, " ".join(f"{k}={_quote(v)}" for k, v in fields.items()))


class Throttle:
    """Log lines that a peer can cause before it has proved the job token, bounded: of each cause
    (an event's name, or its name and a reason from a fixed set), the first line of an interval of
    THROTTLE_S is written, later ones only counted, and the count goes out as one `suppressed`
    line once the interval has passed (at the next line of that cause or the next flush())."""

    def __init__(
        self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic, interval_s: float = THROTTLE_S
    ) -> None:
        self.logger = logger
        self.clock = clock
        self.interval_s = interval_s
        self._causes: Dict[str, List[Any]] = {}  # cause -> [interval end, lines left out, level]
        self.suppressed = 0  # lines left out in all, for tests and the stop summary

    def event(self, level: int, name: str, cause: Optional[str] = None, **fields: Any) -> bool:
        """`event(logger, level, name, **fields)` unless this cause was logged in its current
        interval; whether the line was written."""
        key = name if cause is None else f"{name}:{cause}"
        now = self.clock()
        state = self._causes.get(key)
        if state is not None and now < state[0]:
            state[1] += 1
            self.suppressed += 1
            return False
        if state is not None:
            self._summarise(key, state)
        elif len(self._causes) >= MAX_THROTTLED_CAUSES:
            oldest = min(self._causes, key=lambda k: self._causes[k][0])
            self._summarise(oldest, self._causes.pop(oldest))
        self._causes[key] = [now + self.interval_s, 0, level]
        event(self.logger, level, name, **fields)
        return True

    def flush(self, everything: bool = False) -> None:
        """Write the summary of every interval that has passed (every one, at a process's end), and
        forget those causes."""
        now = self.clock()
        for key in [k for k, state in self._causes.items() if everything or now >= state[0]]:
            self._summarise(key, self._causes.pop(key))

    def _summarise(self, key: str, state: List[Any]) -> None:
        if state[1]:
            event(self.logger, state[2], "suppressed", what=key, lines=state[1], interval_s=self.interval_s)
