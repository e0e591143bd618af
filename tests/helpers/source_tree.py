"""The project's source tree, by the module names it has once installed (setup.py's mapping)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[2]
# Where each installed package's sources live in the repository (as setup.py maps them).
SOURCE_ROOTS = {"reduction_server": "reduction_server", "reduction_server.client": "client",
                "reduction_server.bench": "bench"}


def source_modules() -> Dict[str, Path]:
    """Every module of the source tree, by its installed name, and its file."""
    modules = {}
    for package, directory in SOURCE_ROOTS.items():
        base = ROOT / directory
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules
