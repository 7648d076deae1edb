#!/usr/bin/env python3
"""Regenerate kvstore_client/_proto from proto/ (the one way generated code is made).

`--check` regenerates into a temporary folder and fails if anything differs, so CI
catches a .proto edited without regenerating.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "kvstore_client" / "_proto"
PACKAGE = "kvstore_client._proto"


def generate(out: pathlib.Path) -> None:
    from grpc_tools import protoc  # only needed by developers and CI

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # protoc writes absolute imports ("from kvstore.v1 import x_pb2"); make them point
    # into our package so the generated code needs nothing on sys.path.
    for path in out.rglob("*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^from kvstore\.v1 import", f"from {PACKAGE}.kvstore.v1 import",
                       text, flags=re.M)
        if fixed != text:
            path.write_text(fixed)
    for folder in [out, *(d for d in out.rglob("*") if d.is_dir())]:
        (folder / "__init__.py").touch()


def differences(a: pathlib.Path, b: pathlib.Path) -> list[str]:
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [f"{p}: only in one tree" for p in cmp.left_only + cmp.right_only]
    out += [f"{p}: differs" for p in cmp.diff_files]
    for name, sub in cmp.subdirs.items():
        out += [f"{name}/{d}" for d in differences(a / name, b / name)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the checked-in code is stale")
    args = parser.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = pathlib.Path(tmp) / "_proto"
            generate(fresh)
            stale = differences(fresh, OUT_DIR)
        if stale:
            print("generated protobuf code is stale; run scripts/gen_protos.py:\n  "
                  + "\n  ".join(stale), file=sys.stderr)
            return 1
        print("generated protobuf code is current")
        return 0
    shutil.rmtree(OUT_DIR, ignore_errors=True)
    generate(OUT_DIR)
    print(f"wrote {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
