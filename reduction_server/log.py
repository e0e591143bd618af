"""Structured logging: one line per event, `event key=value ...`, quiet by default.

RS_LOG_LEVEL (DEBUG, INFO, NOTICE, WARNING, ERROR; default NOTICE) sets the level of every
logger under `reduction_server`. NOTICE, between INFO and WARNING, is for the few lines an
operator wants from a healthy process: a reducer's configuration at start and its summary at
stop. Per-peer and per-round events are INFO or DEBUG; problems are WARNING or ERROR.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

from .config import settings

_configured = False
NOTICE = 25
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
