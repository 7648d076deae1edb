"""The Unix socket's private folder (kvstore_server.fastpath.unixsock): made fresh, never
reused, 0750; removed when its server is gone, never when it is not ours or still live."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from kvstore_server.fastpath import unixsock
from kvstore_server.fastpath.unixsock import SocketFolder, remove_stale_folders, socket_path


def test_a_name_someone_else_made_is_passed_over(tmp_path, monkeypatch):
    names = iter(["0badc0de", "0badc0de", "00c0ffee"])
    monkeypatch.setattr(unixsock.secrets, "token_hex", lambda n: next(names))
    taken = tmp_path / f"kvstore-{os.getpid()}-0badc0de.d"
    taken.mkdir(mode=0o777)
    folder = SocketFolder(str(tmp_path))
    assert folder.path == str(tmp_path / f"kvstore-{os.getpid()}-00c0ffee.d")
    st = os.lstat(folder.path)
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_uid == os.geteuid()
    assert taken.is_dir()                       # the other one is left alone
    folder.close()
    assert not os.path.exists(folder.path)


def test_a_folder_whose_names_are_all_taken_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(unixsock.secrets, "token_hex", lambda n: "0badc0de")
    (tmp_path / f"kvstore-{os.getpid()}-0badc0de.d").mkdir()
    with pytest.raises(OSError, match="fresh folder names were all taken"):
        SocketFolder(str(tmp_path))


def test_a_socket_path_too_long_for_bind_is_refused_up_front(tmp_path):
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    with pytest.raises(OSError, match="too long a path for a Unix socket"):
        SocketFolder(str(deep))


def test_stale_folders_go_live_and_foreign_ones_stay(tmp_path):
    dead_pid = 4_194_305                        # past PID_MAX_LIMIT: no process has it
    stale = tmp_path / f"kvstore-{dead_pid}-00000001.d"
    stale.mkdir()
    (stale / "fast.sock").touch()
    live = tmp_path / f"kvstore-{dead_pid}-00000002.d"   # another pid namespace's server
    live.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path(str(live)))
    listener.listen(1)
    mine = SocketFolder(str(tmp_path))          # our own pid runs
    try:
        assert remove_stale_folders(str(tmp_path)) == [str(stale)]
        assert live.is_dir() and os.path.isdir(mine.path)
    finally:
        listener.close()
        mine.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_another_users_folder_is_never_removed(tmp_path):
    foreign = tmp_path / "kvstore-4194305-00000003.d"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    assert remove_stale_folders(str(tmp_path)) == []
    assert foreign.is_dir()
