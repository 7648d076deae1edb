"""The server's shared-memory region mapped into this process, when it can be.

A client on the server's host maps the region once (Attach gives its path, size and
token) and moves page bytes through it. A server that restarted made a new region: the
client maps it again when the server says the old token is stale (transport.Recovery), or when its
fast path dropped (dataplane.py), and every offset is used with the mapping of the server
that issued it.

Attach also says where the fast path's Unix socket is and who the server runs as
(unixpeer.ServerIdentity): the fast path sends a token over that socket only to a process
of that uid. Each Attach replaces what the last one said; nothing is derived from an old
path (a name in a shared folder may belong to someone else once its server is gone).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable

import grpc

from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb

from .errors import KVStoreError
from .presence import PresenceMap
from .rpc import RETRY_CODES, Rpc
from .shm import TOKEN_BYTES, SharedRegion
from .unixpeer import ServerIdentity

__all__ = ["RegionAttachment"]

log = logging.getLogger(__name__)

PRESENCE_RETRY_S = 5.0      # between attempts to (re)open the presence map


class RegionAttachment:
    """The region of one client's server. shared_memory: None = map it when it can be
    mapped (same host), else None (gRPC); True = require it; False = never map it."""

    def __init__(self, rpc: Rpc, shared_memory: bool | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.shared_memory = shared_memory
        self._clock = clock             # what the presence map's heartbeat is compared with
        self._rpc = rpc
        self._region: SharedRegion | None = None
        self._tried = False
        self._lock = threading.Lock()   # guards attaching and re-attaching
        self._path = ""                 # the region's path, as the last Attach said
        self._identity: ServerIdentity | None = None    # the last Attach's; None = no socket
        self._presence: PresenceMap | None = None     # the server's map, read-only
        self._presence_at = 0.0         # time.monotonic() before which it is not reopened

    def region(self) -> SharedRegion | None:
        """The server's region mapped here, or None when only gRPC can be used."""
        if self._region is None and not self._tried and self.shared_memory is not False:
            self.attach()
        return self._region

    def need(self) -> SharedRegion:
        """The mapped region, or FAILED_PRECONDITION when there is none."""
        region = self.region()
        if region is None:
            raise KVStoreError(grpc.StatusCode.FAILED_PRECONDITION,
                               "the server's shared-memory pool is not mapped (another host, "
                               "or shared_memory=False)")
        return region

    def attach(self, force: bool = False, keep: bool = False) -> None:
        """Map the server's region (again, with force). keep: keep the mapping when Attach
        names the same region (a fast path dropped; the server may not have restarted).
        Never when the server said the token is stale: the token this client sends is then
        not the region's, whatever path and size Attach names, and a mapping kept with it
        (the same path and size were taken for the same region) sent that token again and
        was refused again, on every call."""
        with self._lock:
            if self._tried and not force:
                return
            self._tried = True
            old, self._region = self._region, None
            self._identity = None
            try:
                resp = self._attach()
                if keep and old is not None and _same_region(old, resp):
                    # The same region (a fast path dropped, the server did not restart):
                    # keep the mapping, which an engine registered with CUDA.
                    self._region, old = old, None
                else:
                    # Checked against who Attach says the server is: a hand-out socket
                    # (--shm-group) or a pool file of anyone else is not mapped.
                    self._region = SharedRegion(resp.path, resp.size, resp.token_offset,
                                                _server(resp))
                    log.debug("mapped the server's pool %s (%d bytes)", resp.path,
                              resp.size)
            except (OSError, KVStoreError) as exc:
                if isinstance(exc, KVStoreError) and exc.code in RETRY_CODES:
                    self._tried = False           # the server is down: ask again later
                if self.shared_memory:
                    raise KVStoreError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"shared memory was required but the server's pool "
                                       f"cannot be mapped: {exc}", "Attach") from None
                log.info("server pool not mappable from here (%s); using gRPC for page bytes",
                         exc)
            finally:
                if old is not None:
                    old.close()

    def _attach(self) -> pb.AttachResponse:
        """One Attach call; what it says replaces what the last one said."""
        resp = self._rpc.call("Attach", lambda: self._rpc.attach(
            pb.AttachRequest(), timeout=self._rpc.timeout))
        self._path = resp.path
        self._identity = (ServerIdentity(resp.socket_path, resp.uid, resp.gid, resp.pid)
                          if resp.socket_path else None)
        return resp

    def identity(self) -> ServerIdentity | None:
        """Where the fast path's Unix socket is and who must listen there, as the last
        Attach said (None: no socket, or an older server that does not say who it is)."""
        return self._identity

    def local_socket(self) -> ServerIdentity | None:
        """The fast path's Unix socket, when this host has it, found by a fresh Attach
        without mapping the pool: for a client that only asks and leases (the connector's
        scheduler half): a leased lookup over the Unix socket is quicker than over
        loopback TCP. None: another
        host, a tenant that may not map the pool, or no answer (asked again when the fast
        path is next opened)."""
        self._identity = None
        try:
            self._attach()
        except KVStoreError as exc:
            log.debug("no Unix socket for the fast path: %s", exc)
            return None
        found = self._identity
        try:
            return found if found is not None and stat.S_ISSOCK(
                os.stat(found.socket_path).st_mode) else None
        except OSError:
            return None                        # not on this host (or not visible here)

    def presence(self) -> PresenceMap | None:
        """The server's presence map (kvstore_client.presence) while it is live, else None.
        A map gone stale (its server stopped or restarted) is opened again from a fresh
        Attach, at most every PRESENCE_RETRY_S: a server that does not answer costs that
        one call, not one per lookup."""
        found = self._presence
        if found is not None and found.live():
            return found
        now = time.monotonic()
        if now < self._presence_at or not self._lock.acquire(blocking=False):
            return None                        # not yet, or another thread is opening it
        try:
            self._presence_at = now + PRESENCE_RETRY_S
            old, self._presence = self._presence, None
            if old is not None:
                old.close()
            # Always from a fresh Attach: a path an earlier one gave may, once its server
            # is gone, name another user's file, whose map would answer false misses.
            try:
                resp = self._attach()
            except KVStoreError as exc:
                log.debug("no presence map: %s", exc)
                return None
            try:
                if os.stat(resp.path).st_uid != resp.uid:
                    log.warning("not reading the presence map of %s: it does not belong "
                                "to the server's uid %d", resp.path, resp.uid)
                    return None
                self._presence = PresenceMap.open(resp.path, _server(resp), self._clock)
            except (OSError, ValueError) as exc:
                log.debug("no presence map at %s: %s", self._path, exc)
            return self._presence if self._presence is not None and self._presence.live() \
                else None
        finally:
            self._lock.release()

    def close(self) -> None:
        if self._presence is not None:
            self._presence.close()
            self._presence = None
        if self._region is not None:
            self._region.close()
            self._region = None


def _same_region(region: SharedRegion, resp: pb.AttachResponse) -> bool:
    """Whether Attach names the region mapped: the same path and size, and the token the
    mapping holds at Attach's offset is still the one this client sends (a server that
    restarted onto the same file wrote a new one there)."""
    if region.path != resp.path or region.size != resp.size:
        return False
    at = resp.token_offset
    return (at + TOKEN_BYTES <= region.size
            and region.mem[at:at + TOKEN_BYTES].tobytes() == region.token)


def _server(resp: pb.AttachResponse) -> ServerIdentity | None:
    """Who the server that answered Attach is, to check the pool's path against (its
    hand-out socket, with --shm-group, or its file); None: a server that does not say
    (pid 0), whose hand-out socket is then not used."""
    return ServerIdentity(resp.path, resp.uid, resp.gid, resp.pid) if resp.pid else None
