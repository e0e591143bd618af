"""How a worker process tells its test what it saw: one JSON line on stdout, written whole.

print() to an unbuffered stdout (the tests set PYTHONUNBUFFERED) writes through a raw file, and
a write that a signal interrupts part way returns short: print does not finish it (seen once in
CI: a 200 KB line of weights cut at 128 KiB). A buffered binary stream retries until every byte
is out.
"""
import json
import os
import sys
from typing import Any


def report(result: Any) -> None:
    """Write `result` as one JSON line to stdout, all of it."""
    sys.stdout.flush()
    with os.fdopen(sys.stdout.fileno(), "wb", closefd=False) as out:
        out.write((json.dumps(result) + "\n").encode())
