"""The weights' revision in a layout: ids, keys and the wire, and connector.revision's
fingerprint of a weights folder."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct

import pytest

from connector.revision import fingerprint, resolve
from kvstore_client import PageLayout
from kvstore_client.convert import layout_from_proto, layout_to_proto
from kvstore_server.far.records import LayoutRecord

BASE = PageLayout(model="m", num_layers=2, page_tokens=16, num_kv_heads=4, head_size=16,
                  salt="s")


def test_a_layout_without_a_revision_keeps_its_id():
    # The id every existing page of this layout is stored under, before revisions.
    assert BASE.layout_id.hex() == "be96134c71d8571b64461cff95145e94"


def test_revisions_part_ids_and_key_chains_and_survive_the_wire():
    r1, r2 = (dataclasses.replace(BASE, revision=r) for r in ("r1", "r2"))
    assert len({BASE.layout_id, r1.layout_id, r2.layout_id}) == 3
    assert len({BASE.chain_seed, r1.chain_seed, r2.chain_seed}) == 3
    # The salt's length prefix keeps a revision from passing for part of the salt.
    assert dataclasses.replace(BASE, salt="s\x02\x00r1").layout_id != r1.layout_id
    assert layout_from_proto(layout_to_proto(r1)) == r1
    assert LayoutRecord.of(r1.layout_id, "", r1).revision == "r1"
    with pytest.raises(ValueError, match="revision"):
        dataclasses.replace(BASE, revision="x" * 257)


def _weights(folder, data: bytes, name="model.safetensors"):
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(data)],
                               "data_offsets": [0, len(data)]}}).encode()
    (folder / name).write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "opt"}')
    _weights(folder, bytes(range(256)) * 4096)          # 1 MiB
    return folder


def test_a_fingerprint_follows_the_files_not_their_path_or_times(checkpoint, tmp_path):
    import shutil
    first = fingerprint(checkpoint)
    assert first.startswith("fp-") and len(first) == 27
    copy = tmp_path / "b"
    shutil.copytree(checkpoint, copy, copy_function=shutil.copy)   # new times too
    assert fingerprint(copy) == first


@pytest.mark.parametrize("where", [0, 512 * 1024, 1024 * 1024 - 1],
                         ids=["first", "middle", "last"])
def test_new_weights_in_the_same_shapes_change_the_fingerprint(checkpoint, where):
    first = fingerprint(checkpoint)
    path = checkpoint / "model.safetensors"
    raw = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    raw[start + where] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert fingerprint(checkpoint) != first


def test_a_changed_config_changes_the_fingerprint(checkpoint):
    first = fingerprint(checkpoint)
    (checkpoint / "config.json").write_text('{"model_type": "opt", "rope_theta": 2}')
    assert fingerprint(checkpoint) != first


def test_a_folder_with_nothing_to_fingerprint_gives_no_revision(tmp_path):
    assert fingerprint(tmp_path) == ""


def test_the_config_wins_then_the_engine_then_the_folder(checkpoint):
    assert resolve("step-9", "abc", str(checkpoint)).value == "step-9"
    assert resolve("", "abc", str(checkpoint)).value == "abc"
    assert resolve("", None, str(checkpoint)).value == fingerprint(checkpoint)


def test_an_engine_that_cannot_tell_gets_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="connector.revision"):
        got = resolve("", None, str(tmp_path / "no-such-model"), "SGLang")
    assert got.value == ""
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "set model_revision" in warnings[0].getMessage()


def test_a_single_file_checkpoint_is_fingerprinted(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    first = resolve("", None, str(model)).value
    assert first.startswith("fp-")
    model.write_bytes(b"GGUF" + bytes(range(256)) * 63 + bytes(256))
    assert resolve("", None, str(model)).value != first
