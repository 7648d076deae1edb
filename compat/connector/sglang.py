"""Deprecated: `connector.sglang` is `kvstore_connector.sglang` (see connector/__init__.py)."""

from . import deprecated

deprecated("connector.sglang", "kvstore_connector.sglang")

from kvstore_connector.sglang import *  # noqa: E402, F403
from kvstore_connector.sglang import __all__  # noqa: E402,F401
