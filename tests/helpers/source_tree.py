"""The project's source tree, by the module names it has once installed (setup.py's mapping)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[2]
# Where each installed package's sources live in the repository (as setup.py maps them).
SOURCE_ROOTS = {
    "reduction_server": "reduction_server",
    "reduction_server.client": "client",
    "reduction_server.bench": "bench",
}
# Modules installed beside the package (setup.py's py_modules), by name, and their files.
TOP_MODULES = {"reduction_server_torch_autoload": "reduction_server_torch_autoload.py"}


def source_modules() -> Dict[str, Path]:
    """Every module of the source tree, by its installed name, and its file."""
    modules = {name: ROOT / path for name, path in TOP_MODULES.items()}
    for package, directory in SOURCE_ROOTS.items():
        base = ROOT / directory
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules
