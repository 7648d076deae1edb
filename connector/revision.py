"""The weights' revision a connector's layouts carry, so pages of two revisions never meet.

A model name is not the weights: a name is reused after a fine-tune, an RL trainer syncs
new weights into the same folder every few minutes, a hub repository moves its branch.
KV computed by one set of weights is wrong for another, so every layout (hence every page
key, in every tier) names the revision, found in this order:

1. `model_revision` in the connector's config: what the deployment says (a training
   step, a commit); the only way for weights the engine gets from elsewhere;
2. the engine's own revision (vLLM's `--revision`, `model_config.revision`);
3. a fingerprint of the weights' folder (the model path, or the hub cache's snapshot of
   the model name): config.json, the safetensors index, each weight file's name and size,
   each safetensors file's header, and three 4 KiB samples of each weight file's bytes.
   Headers alone (names, shapes, dtypes, offsets) are the same for every training step
   of one architecture; the samples are what tell an RL step's weights from the last.
   At most 12 KiB of weights a file are read, so a 140 GB folder costs milliseconds,
   and two hosts holding copies of one checkpoint find the same fingerprint.

An engine with none of these (weights from no folder we can see) gets "" and one
WARNING line: its pages are then shared with any other weights of the same model name.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import xxhash

__all__ = ["Revision", "fingerprint", "resolve", "weights_folder"]

log = logging.getLogger(__name__)

_SAMPLE = 4096
_HEADER_MAX = 64 << 20          # a safetensors header past this is not one (spec: 100 MB)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIGS = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
            "params.json")


@dataclasses.dataclass(frozen=True, slots=True)
class Revision:
    """The revision layouts carry ("" = unknown), and where it came from."""

    value: str
    source: str = ""


def _weight_files(folder: Path) -> list[Path]:
    """The weight files of a folder; a single-file checkpoint (a .gguf) is its own."""
    if folder.is_file():
        return [folder] if folder.name.endswith(_WEIGHT_SUFFIXES) else []
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def _samples(path: Path, size: int, start: int) -> Iterable[bytes]:
    """Three small slices of a file's data section: its start, middle and end."""
    span = max(0, size - start)
    with path.open("rb") as f:
        for at in sorted({start, start + max(0, span // 2 - _SAMPLE // 2),
                          start + max(0, span - _SAMPLE)}):
            f.seek(at)
            yield f.read(_SAMPLE)


def fingerprint(folder: str | os.PathLike[str]) -> str:
    """A content fingerprint of a weights folder ("" when it holds no config or weights);
    the same on every host that holds the same files, whatever their paths or times."""
    folder = Path(folder)
    h = xxhash.xxh3_128()
    seen = False
    for name in _CONFIGS:
        path = folder / name
        if path.is_file():
            h.update(f"{name}\0{path.stat().st_size}\0".encode())
            h.update(path.read_bytes())
            seen = True
    for path in _weight_files(folder):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        start = 0
        if path.name.endswith(".safetensors") and size >= 8:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if 0 < length <= min(_HEADER_MAX, size - 8):
                    h.update(f.read(length))
                    start = 8 + length
        for sample in _samples(path, size, start):
            h.update(sample)
        seen = True
    return "fp-" + h.hexdigest()[:24] if seen else ""


def weights_folder(model: str, revision: str | None = None) -> Path | None:
    """The folder a model's weights are loaded from: the path itself (a folder, or a
    single-file checkpoint), or the hub cache's snapshot of a model name (offline:
    nothing is downloaded); None if neither."""
    if not model:
        return None
    path = Path(model).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache  # type: ignore[import-not-found]
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except (ImportError, ValueError, OSError):  # not installed, not a hub name
        return None
    return Path(found).parent if isinstance(found, str) else None


def resolve(explicit: str, engine_revision: str | None, model: str,
            engine: str = "the engine") -> Revision:
    """The revision for a connector's layouts (module docstring's order); logs one
    line saying which, and a WARNING when there is none."""
    if explicit:
        out = Revision(explicit, "model_revision in the connector config")
    elif engine_revision:
        out = Revision(str(engine_revision), f"{engine}'s model revision")
    else:
        folder = weights_folder(model)
        value = fingerprint(folder) if folder is not None else ""
        out = Revision(value, f"a fingerprint of {folder}" if value else "")
        if value and folder is not None and not _weight_files(folder):
            log.warning("kvstore connector: %s holds no weight files, so the revision %s "
                        "fingerprints its config only: set model_revision in the "
                        "connector config if the weights change under one config", folder,
                        value)
    if not out.value:
        log.warning("kvstore connector: the weights' revision of %r is unknown (no "
                    "model_revision in the connector config, no revision from %s, no "
                    "weights folder to fingerprint): its pages are shared with any other "
                    "weights served under that name; set model_revision", model, engine)
    else:
        log.info("kvstore connector: weights revision %s (%s)", out.value, out.source)
    return out

