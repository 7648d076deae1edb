"""Client library for kvstore-server: register layouts, put, look up and get KV pages."""

from kvstore_protocol.layout import PageLayout

from . import moved
from .client import KVStoreClient, LayoutHandle, Lease, PutResult
from .errors import KVStoreError, PagesMissing

moved.install()       # the old paths of what moved to kvstore_protocol, for one release

__all__ = ["KVStoreClient", "KVStoreError", "LayoutHandle", "Lease", "PageLayout", "PagesMissing",
           "PutResult"]
