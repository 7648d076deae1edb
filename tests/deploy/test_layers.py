"""The layering docs/architecture.md states holds in the code: the packages' "may import"
column of its Parts table (kvstore_protocol below kvstore_client and kvstore_server, the
server never importing the client, the connector over the client, bench and testing on
top), and its "Layers inside the server" (a module of kvstore_server imports only modules of
its own layer or below). Both tables are read from the doc, so doc and test cannot drift
apart; every import counts, at any depth: lazy ones in functions and type-only ones under
`if TYPE_CHECKING:` (a type-only import still ties a module to the one it names)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SERVER = "kvstore_server"


@dataclass(frozen=True)
class Import:
    """One module a file imports, and the line that does."""
    path: Path
    line: int
    module: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _roots() -> dict[str, str]:
    """setup.py's ROOTS: each installed import name and the folder it comes from."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", "") == "ROOTS")


def _package_of(path: Path, name: str, folder: str) -> list[str]:
    """The dotted package a file is in, under its import name."""
    parts = list(path.relative_to(ROOT / folder).parent.parts)
    return [name, *parts]


def _imports(path: Path, name: str, folder: str) -> list[Import]:
    """Every absolute module name a file imports, relative imports resolved; for `from X
    import y` both X and X.y (y may be a module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(path, name, folder)
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append(Import(path, node.lineno, module))
            out += [Import(path, node.lineno, f"{module}.{alias.name}")
                    for alias in node.names if alias.name != "*"]
    return out


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"### {title}\n")
    end = text.index("\n#", start + 1)
    return text[start:end]


def _package_rules(roots: dict[str, str]) -> dict[str, set[str]]:
    """Each installed package -> the packages of ours it may import, from the Parts table
    (its folder column names the folder; "never `x`" in the last column is a prohibition,
    and what a package may import, its importers may too)."""
    folder_to_name = {folder.rstrip("/"): name for name, folder in roots.items()}
    direct: dict[str, set[str]] = {}
    for row in DOC.read_text().splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if not row.startswith("| `") or len(cells) != 3:
            continue
        folder = re.match(r"`([^`]+)/`", cells[0])
        if not folder or folder.group(1) not in folder_to_name:
            continue
        may = cells[2]
        if may == "everything":
            allowed = set(roots)
        else:
            allowed = set(re.findall(r"`([^`]+)`", may.split("never")[0]))
        direct[folder_to_name[folder.group(1)]] = allowed
    closed = {}
    for name in direct:
        seen, todo = set(), list(direct[name])
        while todo:
            other = todo.pop()
            if other not in seen:
                seen.add(other)
                todo += direct.get(other, set())
        closed[name] = seen
    return closed


@dataclass(frozen=True)
class Layer:
    """One numbered item of "Layers inside the server"."""
    number: int
    names: tuple[str, ...]      # `x.py` for a module beside main.py, `x/` for a subpackage

    def __str__(self) -> str:
        return f"layer {self.number} ({', '.join(self.names)})"


def _server_layers() -> list[Layer]:
    """The numbered items, bottom up; a name belongs to the first item that names it (a
    later item may mention a lower layer's module, as layer 3 mentions codes.py)."""
    items = re.split(r"^(\d+)\. ", _section("Layers inside the server"), flags=re.M)
    layers, placed = [], set()
    for number, body in zip(items[1::2], items[2::2]):
        body = body.split("\n\n")[0]
        names = [n for n in re.findall(r"`([^`]+)`", body)
                 if re.fullmatch(r"[a-z_]+(\.py|/)", n) and n not in placed]
        placed.update(names)
        layers.append(Layer(int(number), tuple(dict.fromkeys(names))))
    return layers


def _server_key(module: str) -> str | None:
    """The name a server module has in the layer table: its subpackage (`store/`) or, for
    a module beside main.py, its file (`codes.py`); None for what is not a server module."""
    parts = module.split(".")
    if parts[0] != SERVER:
        return None
    if len(parts) == 1:
        return "__init__.py"
    if (ROOT / SERVER / parts[1]).is_dir():
        return f"{parts[1]}/"
    if (ROOT / SERVER / f"{parts[1]}.py").is_file():
        return f"{parts[1]}.py"
    return None                 # a name imported from the package, not a module


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_the_doc_tables_are_read():
    # The checks below must have something to check: a reformatted doc fails here.
    rules = _package_rules(_roots())
    assert rules[SERVER] == {"kvstore_protocol"}
    assert rules["kvstore_protocol"] == set()
    assert {"kvstore_client", "kvstore_protocol"} <= rules["kvstore_connector"]
    layers = _server_layers()
    assert [layer.number for layer in layers] == [1, 2, 3, 4, 5]
    assert "codes.py" in layers[0].names and "codes.py" not in layers[2].names
    assert "rpc/" in layers[3].names and "main.py" in layers[4].names


def test_every_package_imports_only_what_the_parts_table_allows():
    roots = _roots()
    rules = _package_rules(roots)
    assert set(rules) == set(roots), \
        f"docs/architecture.md's Parts table has no row for {sorted(set(roots) - set(rules))}"
    bad: dict[str, str] = {}     # file:line -> what it imports (`from X import y`: X.y)
    for name, folder in roots.items():
        for path in _files(folder):
            for imp in _imports(path, name, folder):
                top = imp.module.split(".")[0]
                if top in roots and top != name and top not in rules[name]:
                    may = sorted(rules[name]) or "nothing of ours"
                    bad[imp.where()] = (f"{imp.where()}: {name} imports {imp.module}; the "
                                        f"Parts table lets {name} import {may}")
    assert not bad, "\n".join(sorted(bad.values()))


def test_no_server_module_imports_a_higher_layer():
    layers = _server_layers()
    layer_of = {n: layer for layer in layers for n in layer.names}
    unplaced: set[str] = set()
    bad: dict[str, str] = {}     # file:line -> what it imports (`from X import y`: X.y)
    for path in _files(SERVER):
        key = _server_key(".".join(_package_of(path, SERVER, SERVER) + [path.stem]))
        if key is None or key not in layer_of:
            unplaced.add(key or str(path.relative_to(ROOT)))
            continue
        for imp in _imports(path, SERVER, SERVER):
            target = _server_key(imp.module)
            if target is None or target == key:
                continue
            if target not in layer_of:
                unplaced.add(target)
            elif layer_of[target].number > layer_of[key].number:
                bad[imp.where()] = (f"{imp.where()}: {key} of {layer_of[key]} imports "
                                    f"{imp.module}, of {layer_of[target]}, above it")
    assert not unplaced, ("no layer in docs/architecture.md's \"Layers inside the server\" "
                          f"names {sorted(unplaced)}")
    assert not bad, "\n".join(sorted(bad.values()))
