"""The fast path beside gRPC: a lean framed protocol for the hot calls (docs/fastpath.md).

server.py listens (TCP, and a Unix socket in a folder of its own: unixsock.py),
connection.py serves one connection, ops.py decodes and encodes the calls (the rules are
kvstore_server/calls.py's, shared with gRPC), io.py the socket I/O.
The wire format itself lives in kvstore_protocol.fastwire, which both ends import.
"""

from .server import FastPathServer
from .unixsock import SocketFolder, remove_stale_folders, socket_path

__all__ = ["FastPathServer", "SocketFolder", "remove_stale_folders", "socket_path"]
