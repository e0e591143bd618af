"""docs/design.md's "Where each concept lives" is the one map of the source tree: every file of
reduction_server/, client/, bench/ and native/ has a row there, and every row a file.

The convention the map follows (and these tests parse): in every table of that section whose
header's first cell is `file`, each row's first cell is one path from the repository's root in
backticks, such as `reduction_server/wire/protocol.py`. The layer table (header `layer`) gives
each layer and, in backticks, the layers it may import, as tests/unit/test_layers.py's MAY_IMPORT
does; in the reducer's and the engine's tables each room imports only rooms above it. A backticked
path anywhere on the page must name a file or folder that exists. A module added to the tree
fails here until it has its row."""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Sequence, Set, Tuple

from test_layers import MAY_IMPORT, import_graph

from helpers.source_tree import ROOT, source_modules

DESIGN = ROOT / "docs" / "design.md"
MAP_HEADING = "## Where each concept lives"
# The packages whose modules are rooms: each imports only the rooms above it in its table.
ROOMED = ("reduction_server/reducer/", "client/engine/")


def tree_files() -> Set[str]:
    """Every file the map must name: the installed packages' modules, and native/'s sources (not
    the C file Cython generates from a .pyx)."""
    files = {path.relative_to(ROOT).as_posix() for path in source_modules().values()}
    native = ROOT / "native"
    for path in native.iterdir():
        generated = path.suffix == ".c" and path.with_suffix(".pyx").exists()
        if path.is_file() and path.suffix in (".pyx", ".pxd", ".h", ".c") and not generated:
            files.add(path.relative_to(ROOT).as_posix())
    return files


def map_section(page: str) -> str:
    """The text of the map's section: from its heading to the next heading of its level."""
    start = page.index(MAP_HEADING)
    end = page.find("\n## ", start + len(MAP_HEADING))
    return page[start:] if end < 0 else page[start:end]


def tables(section: str) -> List[Tuple[List[str], List[List[str]]]]:
    """Each markdown table of the section: its header's cells and its rows' cells."""
    found: List[Tuple[List[str], List[List[str]]]] = []
    lines: List[str] = []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            lines.append(line)
            continue
        if lines:
            cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in lines]
            rows = [row for row in cells[1:] if not all(set(cell) <= set("-: ") for cell in row)]
            found.append((cells[0], rows))
            lines = []
    return found


def map_rows(section: str) -> Tuple[List[str], List[str]]:
    """The paths the map's rows name, in order, and the rows whose first cell is not one
    backticked path."""
    paths, malformed = [], []
    for header, rows in tables(section):
        if header[0] != "file":
            continue
        for row in rows:
            match = re.fullmatch(r"`([^`]+)`", row[0])
            if match:
                paths.append(match.group(1))
            else:
                malformed.append(" | ".join(row))
    return paths, malformed


def map_problems(section: str, files: Set[str]) -> Dict[str, List[str]]:
    """What is wrong with the map against the tree's files: files with no row, rows naming no
    file of the tree, files with two rows, rows it cannot read. Empty when the map is right."""
    paths, malformed = map_rows(section)
    problems = {
        "no row in the map": sorted(files - set(paths)),
        "a row but not in the tree": sorted(set(paths) - files),
        "more than one row": sorted({path for path in paths if paths.count(path) > 1}),
        "first cell is not one `path`": malformed,
    }
    return {what: which for what, which in problems.items() if which}


def named_paths(page: str) -> Set[str]:
    """Every backticked token of the page that reads as a path in the repository: it has a slash
    and only a path's characters (`client/engine/`, `.ci/run`; not `--host/--port`)."""
    tokens = re.findall(r"`([^`\n]+)`", page)
    return {token for token in tokens if "/" in token and re.fullmatch(r"\.?[A-Za-z0-9_][\w.\-]*(/[\w.\-]+)*/?", token)}


def layer_rule(section: str) -> Dict[str, Set[str]]:
    """The layer table: each layer and the layers it may import (what is in parentheses is a
    note)."""
    rule: Dict[str, Set[str]] = {}
    for header, rows in tables(section):
        if header[0] != "layer":
            continue
        for row in rows:
            layer = row[0].strip("`")
            rule[layer] = set(re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", row[1])))
    return rule


def rooms_out_of_order(order: Sequence[str], graph: Dict[str, Set[str]]) -> Dict[str, List[str]]:
    """Each room's imports of rooms that come after it (or are not in `order` at all, when they
    are of its own package), for rooms in their table's order."""
    wrong = {}
    for i, room in enumerate(order):
        package = room.rsplit(".", 1)[0]
        later = sorted(
            t for t in graph.get(room, ()) if t.rsplit(".", 1)[0] == package and t != package and t not in order[:i]
        )
        if later:
            wrong[room] = later
    return wrong


def _module_names(paths: Iterable[str]) -> List[str]:
    by_path = {path.relative_to(ROOT).as_posix(): name for name, path in source_modules().items()}
    return [by_path[path] for path in paths if path in by_path and not path.endswith("/__init__.py")]


def test_every_file_of_the_tree_has_one_row_in_the_map():
    assert map_problems(map_section(DESIGN.read_text()), tree_files()) == {}


def test_the_map_check_reports_a_module_with_no_row_and_a_row_with_no_module():
    section = map_section(DESIGN.read_text()).replace(
        "| `reduction_server/reducer/clock.py` |",
        "| `reduction_server/reducer/gone.py` | a room that is not there |\n| `reduction_server/reducer/clock.py` |",
    )
    files = tree_files() | {"reduction_server/reducer/made_up_room.py"}
    assert map_problems(section, files) == {
        "no row in the map": ["reduction_server/reducer/made_up_room.py"],
        "a row but not in the tree": ["reduction_server/reducer/gone.py"],
    }


def test_the_map_check_reports_a_file_named_twice_and_a_row_it_cannot_read():
    section = (
        "## Where each concept lives\n\n| file | what it holds |\n| --- | --- |\n"
        "| `a/b.py` | one |\n| `a/b.py` | the same again |\n| a/c.py | no backticks |\n\n## Next\n"
    )
    assert map_problems(section, {"a/b.py", "a/c.py"}) == {
        "no row in the map": ["a/c.py"],
        "more than one row": ["a/b.py"],
        "first cell is not one `path`": ["a/c.py | no backticks"],
    }


def test_the_map_names_native_sources():
    assert {"native/_native.pyx", "native/kernels.h"} <= set(map_rows(map_section(DESIGN.read_text()))[0])


def test_every_path_the_page_names_exists():
    assert sorted(path for path in named_paths(DESIGN.read_text()) if not (ROOT / path).exists()) == []


def test_the_path_check_finds_a_moved_file():
    page = "Sums in (`reduction_server/round.py`, `native/`), see `--host/--port` and `RS_RANK`/`RS_WORLD_SIZE`."
    assert named_paths(page) == {"reduction_server/round.py", "native/"}


def test_the_layer_table_is_the_rule_test_layers_checks():
    assert layer_rule(map_section(DESIGN.read_text())) == MAY_IMPORT


def test_each_room_imports_only_the_rooms_above_it_in_its_table():
    paths = map_rows(map_section(DESIGN.read_text()))[0]
    graph = import_graph()
    for package in ROOMED:
        order = _module_names(path for path in paths if path.startswith(package))
        assert rooms_out_of_order(order, graph) == {}, f"{package}: rooms import rooms below them in the map"


def test_the_order_check_finds_a_room_importing_one_below_it():
    graph = {"p.r.clock": set(), "p.r.rounds": {"p.r.clock", "p.r.finals", "p.wire"}, "p.r.finals": {"p.r.clock"}}
    assert rooms_out_of_order(["p.r.clock", "p.r.rounds", "p.r.finals"], graph) == {"p.r.rounds": ["p.r.finals"]}
