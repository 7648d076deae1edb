"""Reading deploy/: its files, the commands inside them, and the real server they start.

The tests run the command lines written in the Dockerfile, compose.yaml and the Kubernetes
manifests, not copies of them. What must change to run them here (a container path, a port
that may be taken on this machine) is mapped by the helpers below, and only that.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore_testing.serverproc import ServerProcess

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
# The commands in the files (kvstore-server, kvstore-admin) are the package's scripts:
# look for them beside this Python first, as in the image, where the venv is on PATH.
PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"


def yaml_module():
    """PyYAML, or a skip of the calling test that says it is missing."""
    return pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")


def load_yaml_docs(path: Path) -> list[dict]:
    yaml = yaml_module()
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def k8s_object(kind: str, name: str | None = None, folder: Path = K8S) -> dict:
    """The one manifest of this kind (and name) under folder, overlays aside."""
    found = [d for p in sorted(folder.rglob("*.yaml")) if "overlays" not in p.parts
             for d in load_yaml_docs(p)
             if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} under {folder}, got {len(found)}"
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] + pod_spec.get("initContainers", [])
                if c["name"] == name)


def expand_k8s(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def expand_compose(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR} interpolation."""
    def one(m):
        name, default = m.group(1), m.group(3)
        return env.get(name) or (default if default is not None else "")
    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", one, text)


def dockerfile(path: Path = DEPLOY / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines, buf = [], ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue
        buf += raw.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        if buf.strip():
            word, _, rest = buf.strip().partition(" ")
            lines.append((word.upper(), rest.strip()))
        buf = ""
    return lines


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The instructions of the last stage: what `docker build` makes by default."""
    start = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[start:]


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec form) argument: ENTRYPOINT ["a", "b"]."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), args
    return value


def healthcheck_command(stage: list[tuple[str, str]]) -> list[str]:
    args = next(rest for word, rest in stage if word == "HEALTHCHECK")
    _options, _, cmd = args.partition(" CMD ")
    return exec_form(cmd.strip())


def with_port(argv: list[str], old: str, new: str) -> list[str]:
    """argv with the address `old` (as written in a file) replaced by `new` (this test's)."""
    assert any(old in a for a in argv), f"{old} not in {argv}"
    return [a.replace(old, new) for a in argv]


def run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a command line from a file; its program must be on PATH (ours: the venv's bin)."""
    assert shutil.which(argv[0], path=PATH), f"{argv[0]} is not on {PATH}"
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PATH": PATH})


class CommandServer(ServerProcess):
    """A server started by a command line from a file rather than by ServerProcess's own."""

    def __init__(self, argv: list[str], address: str, env: dict[str, str]) -> None:
        super().__init__(port=int(address.rpartition(":")[2]), env={**env, "PATH": PATH})
        self.argv = argv

    def start(self, wait: float = 30.0) -> CommandServer:
        assert shutil.which(self.argv[0], path=self.env.get("PATH")), self.argv[0]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the server's log while it runs
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env)
        self.wait_healthy(wait)
        return self


def remap_toml(text: str, mounts: dict[str, Path]) -> str:
    """A TOML whose string values under a container mount point at the host folder."""
    table = tomllib.loads(text)
    for key, value in table.items():
        if isinstance(value, str):
            for inside, outside in mounts.items():
                if value == inside or value.startswith(inside + "/"):
                    new = str(outside) + value[len(inside):]
                    text = re.sub(rf'^(\s*{key}\s*=\s*)"{re.escape(value)}"',
                                  lambda m: f'{m.group(1)}"{new}"', text, flags=re.M)
    return text
