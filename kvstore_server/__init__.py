"""kvstore-server: the KV page store daemon."""

__version__ = "0.1.0"
