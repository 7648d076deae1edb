"""Settings files read with bounds, and the error a bad setting raises: what the config
file (config.py) and the auth file (auth.py) share.

Why a module of its own: config.py reads every setting of the daemon and imports the
layers whose defaults and bounds it checks (the store, the RPC layer's request limits,
the far tier), so it stands above them; auth.py, below the RPC layer, needs only how a
settings file is read and how a bad one is reported.
"""

from __future__ import annotations

import os
import stat
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = ["ConfigError", "read_toml"]


class ConfigError(ValueError):
    """A configuration value is malformed; the message names the source and the key."""


# Settings files are small; one bigger than this is not one.
_TOML_MAX_BYTES = 1 << 20


def read_toml(path: str, what: str) -> dict[str, Any]:
    """A TOML file's table; ConfigError naming `what` and the path on any problem. Only
    a regular file is read: a FIFO in its place blocked the start (or a SIGHUP's
    reload, which then held its lock for good) in open(), and a file that is not UTF-8
    raised UnicodeDecodeError past the handlers."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"cannot read {what} {path}: not a regular file")
            if st.st_size > _TOML_MAX_BYTES:
                raise ConfigError(f"cannot read {what} {path}: {st.st_size} bytes, more "
                                  f"than a settings file holds ({_TOML_MAX_BYTES})")
            return tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {what} {path}: {exc}") from None
