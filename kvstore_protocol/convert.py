"""Conversions between the wire messages and the typed values everyone else uses."""

from __future__ import annotations

from ._proto.kvstore.v1 import kvstore_pb2 as pb
from .layout import PageLayout

__all__ = ["layout_from_proto", "layout_to_proto"]

_FIELDS = ("model", "dtype", "num_layers", "page_tokens", "num_kv_heads", "head_size",
           "kv_factor", "tp_rank", "tp_size", "pp_rank", "salt", "revision")


def layout_to_proto(layout: PageLayout) -> pb.Layout:
    return pb.Layout(**{name: getattr(layout, name) for name in _FIELDS})


def layout_from_proto(msg: pb.Layout) -> PageLayout:
    """ValueError with every problem listed when the message is not a valid layout."""
    return PageLayout(**{name: getattr(msg, name) for name in _FIELDS})
