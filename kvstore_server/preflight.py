"""Checks of this host against a config before anything is allocated or bound.

`kvstore-server` runs these after parsing and before it binds a port or creates the pool,
and `--check-config` runs them alone. Each failure is a ConfigError whose message starts
with the setting it is about, so the one line the server prints tells an operator what
to change. Why up front: before these checks a pool larger than /dev/shm died of SIGBUS
half-way through its pre-fault, and a bad TLS or disk setting was found only after a
64 GiB pool had been faulted in (minutes), under a systemd unit that restarts on failure.

What is checked, in order: the group, each TLS file, the auth file, the fast path's TCP
congestion control (a socket of its own is given it, as the listener will be), the disk tier's
folder (writable; free space plus its slot files' space covers `disk`), the pool's folder
(a writable folder with room for the pool) and the host's memory (MemAvailable, and the
cgroup's memory.max where one is set; tmpfs pages count against both). The memory figures
are a snapshot: another process may take memory before the pool is allocated, which is
why the pool is also allocated with posix_fallocate (region.py) rather than trusted.
"""

from __future__ import annotations

import dataclasses
import os

from kvstore_protocol.congestion import CongestionRefused, check_congestion
from kvstore_protocol.units import format_size

from .auth import Authenticator
from .config import ConfigError, ServerConfig

__all__ = ["HostMemory", "check_host", "host_memory"]

_HUGETLBFS_MAGIC = 0x958458F6


@dataclasses.dataclass(frozen=True, slots=True)
class HostMemory:
    """Memory a new tmpfs page can come from, in bytes; None where not known."""

    available: int | None           # /proc/meminfo MemAvailable
    cgroup_left: int | None         # memory.max - memory.current of our cgroup (v2)


def check_host(config: ServerConfig, pool_bytes: int, memory: HostMemory | None = None) -> None:
    """Raise ConfigError (naming the setting) for the first setting this host cannot honour.
    pool_bytes: the pool file's size (the DRAM pool rounded up, plus its header)."""
    c = config
    if c.shm_group:
        import grp
        try:
            grp.getgrnam(c.shm_group)
        except KeyError:
            raise ConfigError(f"shm_group: no group {c.shm_group!r} on this host") from None
    for setting in ("tls_cert", "tls_key", "tls_client_ca"):
        _readable(setting, getattr(c, setting))
    if c.auth_file:
        Authenticator(c.auth_file)      # ConfigError names the file and the entry
    if c.data_congestion:
        try:
            check_congestion(c.data_congestion)
        except CongestionRefused as exc:
            raise ConfigError(f"data_congestion: {exc}") from None
    if c.disk:
        _check_disk_dir(c.disk_dir, c.disk)
    # With a group the pool is a memfd (region.py): shm_dir holds only its socket.
    _check_shm_dir(c.shm_dir, c.dram, 0 if c.shm_group else pool_bytes)
    _check_memory(c.dram, pool_bytes, c.shm_dir, memory or host_memory())


def _readable(setting: str, path: str) -> None:
    if not path:
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None


def _check_disk_dir(directory: str, capacity: int) -> None:
    # The folder may not exist yet (the tier creates it): check the nearest one that does.
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"disk_dir: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"disk_dir: {existing} is not writable by this user")
    st = os.statvfs(existing)
    free = st.f_bavail * st.f_frsize
    # Slot files already there hold pages from before: their space is the tier's too.
    held = 0
    if existing == os.path.abspath(directory):
        for entry in os.scandir(existing):
            if entry.is_file(follow_symlinks=False):
                held += entry.stat(follow_symlinks=False).st_blocks * 512
    if capacity > free + held:
        raise ConfigError(f"disk: {format_size(capacity)} does not fit in disk_dir "
                          f"{directory}: {format_size(free)} free"
                          + (f" plus {format_size(held)} of slot files" if held else ""))


def _check_shm_dir(directory: str, dram: int, pool_bytes: int) -> None:
    if not os.path.isdir(directory):
        raise ConfigError(f"shm_dir: {directory} is not a folder")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"shm_dir: {directory} is not writable by this user")
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if pool_bytes > free:
        raise ConfigError(f"dram: {format_size(dram)} does not fit in shm_dir {directory}: "
                          f"{format_size(free)} free")


def _check_memory(dram: int, pool_bytes: int, shm_dir: str, memory: HostMemory) -> None:
    # Huge pages are set aside at boot, not taken from MemAvailable: statvfs said enough.
    if _fs_type(shm_dir) == _HUGETLBFS_MAGIC:
        return
    if memory.available is not None and pool_bytes > memory.available:
        raise ConfigError(f"dram: {format_size(dram)} is more than this host's available "
                          f"memory ({format_size(memory.available)} MemAvailable)")
    if memory.cgroup_left is not None and pool_bytes > memory.cgroup_left:
        raise ConfigError(f"dram: {format_size(dram)} is more than this cgroup may still "
                          f"use ({format_size(memory.cgroup_left)} under memory.max)")


def host_memory() -> HostMemory:
    """This host's MemAvailable and what our cgroup (v2) may still use."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return HostMemory(available, _cgroup_left())


def _cgroup_left() -> int | None:
    try:
        with open("/proc/self/cgroup") as f:
            paths = [line.strip().partition("::")[2] for line in f if line.startswith("0::")]
        base = os.path.join("/sys/fs/cgroup", paths[0].lstrip("/")) if paths else None
        if base is None:
            return None
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(base, "memory.current")) as f:
            current = int(f.read())
    except (OSError, ValueError, IndexError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)


def _fs_type(path: str) -> int | None:
    """The f_type of the file system holding path (os.statvfs does not give it)."""
    import ctypes
    import ctypes.util

    class _StatFs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = _StatFs()
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return None
    return buf.f_type & 0xFFFFFFFF
