"""Client library for kvstore-server: register layouts, put, look up and get KV pages."""

from .client import KVStoreClient, Lease, LayoutHandle, PutResult
from .errors import KVStoreError, PagesMissing
from .layout import PageLayout

__all__ = ["KVStoreClient", "PageLayout", "LayoutHandle", "PutResult", "Lease", "KVStoreError",
           "PagesMissing"]
