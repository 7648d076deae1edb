"""Deprecated: `connector.vllm` is `kvstore_connector.vllm` (see connector/__init__.py)."""

from . import deprecated

deprecated("connector.vllm", "kvstore_connector.vllm")

from kvstore_connector.vllm import *  # noqa: E402, F403
from kvstore_connector.vllm import __all__  # noqa: E402,F401
