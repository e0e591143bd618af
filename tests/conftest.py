"""Shared test setup: the suite tests the installed package, never the source tree.

`python -m pytest` puts the working directory first on sys.path, and in a checkout that is the
uncompiled tree (no native extension, no client package): it is taken off here, before any test
imports reduction_server. The tests then run from tests/, which holds no reduction_server, so a
child process that a test starts as `python -m reduction_server` imports the installed package too.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent

sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]


@pytest.fixture(scope="session", autouse=True)
def _away_from_the_tree() -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(ROOT / "tests")
    try:
        yield
    finally:
        os.chdir(previous)
