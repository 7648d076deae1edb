"""kvstore_protocol is the one place both ends' contract lives: the daemon imports it and
never the client library (which would load the channel, the fast path's client and the
rest into the server), the protocol imports neither end, and the old kvstore_client paths
of what moved there still import, as the very same modules, with a DeprecationWarning."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import warnings

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _imported(path: pathlib.Path) -> set[str]:
    """Every absolute module name a file imports (at any depth, lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _importers(folder: str, of: tuple[str, ...]) -> list[str]:
    return sorted(f"{path.relative_to(REPO)}: {name}"
                  for path in (REPO / folder).rglob("*.py")
                  for name in _imported(path)
                  if name.split(".")[0] in of)


def test_no_server_module_imports_the_client():
    assert _importers("kvstore_server", ("kvstore_client",)) == []


def test_the_protocol_imports_neither_end():
    assert _importers("kvstore_protocol", ("kvstore_client", "kvstore_server",
                                           "kvstore_connector", "connector")) == []


def test_the_running_server_loads_no_client_module(tmp_path):
    # Every module of the server imported, as the daemon and its tiers import them.
    code = ("import pkgutil, sys, importlib, kvstore_server\n"
            "for m in pkgutil.walk_packages(kvstore_server.__path__, 'kvstore_server.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(len([m for m in sys.modules if m.startswith('kvstore_server.')]))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kvstore_client'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, client = out.stdout.splitlines()
    assert int(loaded) > 40            # the walk did find the server's modules
    assert client == "[]"


@pytest.mark.parametrize("old", ["kvstore_client.keys", "kvstore_client.layout",
                                 "kvstore_client.convert", "kvstore_client.units",
                                 "kvstore_client.fastwire", "kvstore_client.malloc",
                                 "kvstore_client.wire", "kvstore_client._proto",
                                 "kvstore_client.handles"])
def test_an_old_path_is_the_moved_module(old):
    import importlib

    from kvstore_client.moved import MOVED

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    assert module is new and module.__name__ == MOVED[old]
    assert module.__spec__ is not None and module.__spec__.name == MOVED[old]
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"the module path {old} is deprecated and goes in the next release: use {MOVED[old]}"]


def test_old_paths_of_generated_code_give_the_same_messages():
    from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from kvstore_client._proto.kvstore.v1 import kvstore_pb2 as old
        from kvstore_client._proto.kvstore.v1.kvstore_pb2 import LookupRequest
    assert old is kvstore_pb2 and LookupRequest is kvstore_pb2.LookupRequest
