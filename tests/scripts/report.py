"""How a worker process tells its test what it saw: one JSON line (or a line of text) on stdout,
written whole.

print() to an unbuffered stdout (the tests set PYTHONUNBUFFERED) writes through a raw file, and
a write that a signal interrupts part way returns short: print does not finish it (seen once in
CI: a 200 KB line of weights cut at 128 KiB). It also writes the text and its newline apart, so
two processes that share a stdout (torchrun's workers) can join their lines (seen once in CI).
A buffered binary stream retries until every byte is out, and writes a short line in one piece.
"""

import json
import os
import sys
from typing import Any


def report(result: Any) -> None:
    """Write `result` as one JSON line to stdout, all of it."""
    say(json.dumps(result))


def say(line: str) -> None:
    """Write one line to stdout, all of it, in one write where it is short (under 4 KiB, a pipe's
    atomic write): never joined with another process's line."""
    sys.stdout.flush()
    with os.fdopen(sys.stdout.fileno(), "wb", closefd=False) as out:
        out.write((line + "\n").encode())
