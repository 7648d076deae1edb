"""The fleet's far-tier secrets: the keys that sign every value a server writes to the
cluster and check every value it reads (codec.py).

Every server of one fleet holds the same secret file (`--far-secret-file`): one secret a
line, blank lines and `#` comments skipped, each at least MIN_SECRET bytes (e.g. the 64
hex digits of `openssl rand -hex 32`). The first line signs what this server writes;
every line is accepted when reading. So a secret rotates without downtime, in three
steps each rolled over the whole fleet: add the new secret as a second line (every
server now reads both); move it to the first line (writes use it, the old one still
reads); once values signed with the old one are gone (--far-ttl, or a clear), drop it.
A value signed with a secret no longer held is a miss, counted as `unknown_key`.

The file is read again when it changes (its inode, size or mtime, looked at no more than
once a CHECK_INTERVAL), so a rotation needs no restart and no signal. A file that has
become unreadable or invalid keeps the secrets in force, logged once per change: a bad
edit must not take the far tier's reads down with it.

Each secret is not used as it is: a MAC key and a key id are derived from it with
HMAC-SHA256 under distinct labels, so neither reveals the secret or the other. The key id
(8 bytes) travels in each value's header so a reader picks the right key at once rather
than trying each. Keys are per fleet, not per tenant: every server holds the fleet's
secret and the tenant-scoped layout id is inside what the MAC covers, so keys derived per
tenant from the same secret would bind nothing more (they would only if servers held
different tenants' secrets, which a shared cache fleet does not).

Without a secret (`--far-insecure`) the server signs with a key every copy of this code
knows (INSECURE): values are checked for integrity, not for who wrote them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field

__all__ = ["CHECK_INTERVAL", "INSECURE", "MIN_SECRET", "Key", "Keyring", "SecretFile",
           "load"]

log = logging.getLogger("kvstore.far")

MIN_SECRET = 32             # bytes a secret line must have: 128 bits of hex at least
CHECK_INTERVAL = 1.0        # seconds between looks at the file for a change

_MAC_LABEL = b"kvstore far value mac v2"
_ID_LABEL = b"kvstore far key id v2"


@dataclass(frozen=True, slots=True)
class Key:
    """One derived key: its id (in each value's header) and the MAC state it starts from."""

    key_id: bytes                                   # 8 bytes
    mac: hmac.HMAC = field(repr=False)              # copied per value, never updated

    @classmethod
    def of(cls, secret: bytes) -> Key:
        key_id = hmac.digest(secret, _ID_LABEL, "sha256")[:8]
        mac_key = hmac.digest(secret, _MAC_LABEL, "sha256")
        return cls(key_id, hmac.new(mac_key, digestmod=hashlib.sha256))


@dataclass(frozen=True, slots=True)
class Keyring:
    """The keys a server holds: `writing` signs, every one of `by_id` verifies."""

    writing: Key
    by_id: dict[bytes, Key] = field(repr=False)

    @classmethod
    def of(cls, secrets: list[bytes]) -> Keyring:
        if not secrets:
            raise ValueError("no secret")
        keys = [Key.of(s) for s in secrets]
        return cls(keys[0], {k.key_id: k for k in keys})

    def keyring(self) -> Keyring:
        return self

    def key(self, key_id: bytes) -> Key | None:
        return self.by_id.get(key_id)


INSECURE = Keyring.of([b"kvstore far tier without a secret: --far-insecure"])


def _parse(data: bytes, path: str) -> list[bytes]:
    secrets = []
    for n, line in enumerate(data.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(b"#"):
            continue
        if len(line) < MIN_SECRET:
            raise ValueError(f"far secret file {path}, line {n}: a secret needs at least "
                             f"{MIN_SECRET} bytes (e.g. openssl rand -hex 32), got {len(line)}")
        secrets.append(line)
    if not secrets:
        raise ValueError(f"far secret file {path} holds no secret")
    return secrets


def load(path: str) -> Keyring:
    """The keyring of a secret file; ValueError says what is wrong with it."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as exc:
        raise ValueError(f"far secret file: {exc}") from None
    return Keyring.of(_parse(data, path))


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class SecretFile:
    """A secret file's keyring, read again when the file changes."""

    def __init__(self, path: str, clock=time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()       # guards the three below: one reloader at a time
        self._stamp = _stamp(path)
        self._current = load(path)          # raises: a bad file at start refuses to start
        mode = os.stat(path).st_mode
        if mode & 0o077:
            log.warning("far secret file %s is readable or writable by others (mode %o): "
                        "whoever reads it can sign pages every server serves; chmod 0400",
                        path, mode & 0o777)
        self._next_check = clock() + CHECK_INTERVAL

    def keyring(self) -> Keyring:
        """The keyring now; looks at the file at most once a CHECK_INTERVAL."""
        if self._clock() < self._next_check:
            return self._current
        with self._lock:
            if self._clock() >= self._next_check:
                self._next_check = self._clock() + CHECK_INTERVAL
                stamp = _stamp(self.path)
                if stamp != self._stamp:
                    self._stamp = stamp
                    self._reload()
            return self._current

    def _reload(self) -> None:
        try:
            ring = load(self.path)
        except ValueError as exc:
            log.error("far secrets: %s; keeping the %d secrets in force", exc,
                      len(self._current.by_id))
            return
        log.info("far secrets: %d read from %s, signing with key id %s", len(ring.by_id),
                 self.path, ring.writing.key_id.hex())
        self._current = ring
