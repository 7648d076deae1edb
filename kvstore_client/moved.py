"""Old import paths of modules that moved (most to kvstore_protocol), kept for one release.

What both ends of the protocol agree on (the generated protobuf code, keys, layouts, both
framings, units, reasons) was in this package, and the server imported it from here,
which loaded the whole client library into the daemon. It now lives in kvstore_protocol.
`import kvstore_client.keys` (and the others in MOVED) still works until the release after
0.1: it gives the very module kvstore_protocol.keys, so a monkeypatch or an isinstance
check sees one object, with a DeprecationWarning. Change such imports to the new path.
One module was renamed in place: kvstore_client.handles is kvstore_client.results (it holds
the values page calls return, not handles).

The old paths are aliases found by an import hook, not files, so the moved files have one
path in the repository and history follows them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

# old module path -> new; a moved package's submodules follow it (kvstore_client._proto.x).
MOVED = {
    "kvstore_client._proto": "kvstore_protocol._proto",
    "kvstore_client.convert": "kvstore_protocol.convert",
    "kvstore_client.fastwire": "kvstore_protocol.fastwire",
    "kvstore_client.keys": "kvstore_protocol.keys",
    "kvstore_client.layout": "kvstore_protocol.layout",
    "kvstore_client.malloc": "kvstore_protocol.malloc",
    "kvstore_client.units": "kvstore_protocol.units",
    "kvstore_client.wire": "kvstore_protocol.grpc_frames",
    # Renamed in place: it holds the values page calls return, not handles.
    "kvstore_client.handles": "kvstore_client.results",
}


def new_name(old: str) -> str | None:
    """The module path `old` moved to, or None if it did not move."""
    for was, now in MOVED.items():
        if old == was or old.startswith(was + "."):
            return now + old[len(was):]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the very module at its new path."""

    def __init__(self) -> None:
        self._own: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        if fullname in MOVED:           # once per moved module, not per submodule
            warnings.warn(f"the module path {fullname} is deprecated and goes in the next "
                          f"release: use {new}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        # The import system stamps the spec returned here on the module; exec_module gives
        # the module its own back, so that it keeps one name.
        self._own[fullname] = module.__spec__
        return importlib.util.spec_from_loader(fullname, self, origin=new,
                                               is_package=hasattr(module, "__path__"))

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return sys.modules[new_name(spec.name) or ""]

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__.name if module.__spec__ else ""
        module.__spec__ = self._own.pop(alias, module.__spec__)


def install() -> None:
    """Put the alias finder on sys.meta_path once (kvstore_client/__init__ calls it); first,
    as the path finder would otherwise load a moved package's submodules a second time
    under the old name (kvstore_client._proto.kvstore: two copies of one protobuf)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
