"""Deprecated alias of `kvstore_connector`, kept for one release.

The connector was installed as a top-level package named `connector`, a name other
distributions use too. It is now `kvstore_connector` (the repository's `connector/`
folder, installed under our own name, as `bench/` is installed as `kvstore_bench`).
Engine configurations that name `connector.vllm` or `connector.sglang` keep working
through this package until the release after 0.1, with a DeprecationWarning and one log
line; change them to `kvstore_connector.vllm` / `kvstore_connector.sglang`.

In a checkout, Python finds the repository's `connector/` folder first when the current
directory is the repository's root (as in the tests): that is the same code under the old
name, without the warning.
"""

from __future__ import annotations

import logging
import warnings

__all__: list[str] = []


def deprecated(old: str, new: str) -> None:
    """Warn (DeprecationWarning, and a log line engines show) that `old` is now `new`."""
    message = (f"the module path {old} is deprecated and goes in the next release: "
               f"use {new}")
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    # DeprecationWarning is hidden by default outside __main__; an engine's log is where
    # an operator will see that the configuration needs a change.
    logging.getLogger(old).warning(message)
