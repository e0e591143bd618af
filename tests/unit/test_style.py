"""The tree's style: ruff's lint and format (pyproject.toml, [tool.ruff]) are clean, so that a
change's diff holds only what it changes. `ruff format .` and `ruff check --fix .` mend most."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.source_tree import ROOT


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean_on_the_tree(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "No module named ruff" not in done.stderr, 'ruff is in the test extra: pip install ".[test]"'
    assert done.returncode == 0, done.stdout + done.stderr
