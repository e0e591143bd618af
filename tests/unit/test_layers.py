"""The house's layers (docs/design.md, "Where each concept lives"): the core never imports the
client, the native kernels import nothing of the package, and no two modules import each other
in a circle, not even inside functions or under TYPE_CHECKING."""

from __future__ import annotations

import ast
from typing import Dict, List, Set

from helpers.source_tree import ROOT, source_modules


def _resolve(module: str, level: int, name: str, is_package: bool) -> str:
    """The absolute name `from <level dots><name>` means inside `module`."""
    if level == 0:
        return name
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def import_graph() -> Dict[str, Set[str]]:
    """Every module's imports of the package's own modules: at the top, in functions, and
    under TYPE_CHECKING alike."""
    modules = source_modules()
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node.level, node.module or "", is_package)
                # `from package import module` imports that module; `from module import name` the module
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every import cycle (Tarjan's strongly connected components of more than one module)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_another_in_a_circle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The command line stands above every layer: `reduction-server bench` runs the benchmarks.
ENTRY_POINTS = (
    "reduction_server.cli",
    "reduction_server.__main__",
    "reduction_server_torch_autoload",
)  # torch's entry point, beside the package


def test_the_core_never_imports_the_client_or_the_benchmarks():
    graph = import_graph()
    core = [
        name
        for name in graph
        if not name.startswith(("reduction_server.client", "reduction_server.bench")) and name not in ENTRY_POINTS
    ]
    wrong = {
        name: sorted(t for t in graph[name] if t.startswith(("reduction_server.client", "reduction_server.bench")))
        for name in core
    }
    assert {name: targets for name, targets in wrong.items() if targets} == {}


# Which packages each package may import (docs/design.md, "The tree"). "base" is the top level's
# shared modules (errors, _version, log, children, the package itself for _native); the command
# line and `python -m reduction_server` stand above every layer.
MAY_IMPORT = {
    "config": {"base"},
    "wire": {"base", "config"},
    "reducer": {"base", "config", "wire"},
    "launch": {"base", "config", "wire"},
    "tools": {"base", "config", "wire"},
    "client": {"base", "config", "wire", "launch"},  # launch.rendezvous: the elastic rendezvous a worker joins
    "bench": {"base", "config", "wire", "tools", "client"},
    "base": {"base", "config"},  # log reads RS_LOG_LEVEL
    "face": {"base", "wire"},  # the package's own __init__ re-exports the errors and the protocol's enums
}
PACKAGES = ("wire", "config", "reducer", "launch", "tools", "client", "bench")


def package_of(module: str) -> str:
    """The layer a module belongs to: one of PACKAGES, "base", "face" (the package's __init__) or
    "entry" (the command line)."""
    if module in ENTRY_POINTS:
        return "entry"
    if module == "reduction_server":
        return "face"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in PACKAGES) else "base"


def layer_violations(graph: Dict[str, Set[str]]) -> Dict[str, List[str]]:
    """Each module's imports of a package its own package may not import."""
    wrong = {}
    for name, targets in graph.items():
        own = package_of(name)
        if own == "entry":
            continue
        # the package itself (its errors, _native) runs before any of its modules, so any may name it
        bad = sorted(t for t in targets if package_of(t) not in (own, "face") and package_of(t) not in MAY_IMPORT[own])
        if bad:
            wrong[name] = bad
    return wrong


def test_each_package_imports_only_the_layers_below_it():
    assert layer_violations(import_graph()) == {}


def test_the_layer_check_finds_a_wire_module_importing_the_reducer():
    graph = {
        "reduction_server.wire.protocol": {"reduction_server.reducer.round", "reduction_server.errors"},
        "reduction_server.reducer.round": {"reduction_server.wire.protocol"},
    }
    assert layer_violations(graph) == {"reduction_server.wire.protocol": ["reduction_server.reducer.round"]}


def test_every_module_belongs_to_a_layer():
    assert {package_of(name) for name in import_graph()} <= {*PACKAGES, "base", "entry", "face"}


def test_the_native_kernels_import_nothing_of_the_package():
    lines = (ROOT / "native" / "_native.pyx").read_text().splitlines()
    imports = [line for line in lines if line.startswith(("import ", "from ", "cimport "))]
    assert imports and not [line for line in imports if "reduction_server" in line or line.startswith("from .")]
