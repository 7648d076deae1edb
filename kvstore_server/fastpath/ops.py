"""The fast path's calls: each decodes its body, calls the one transport-neutral call
(kvstore_server.rpc.calls, which applies every rule the gRPC path applies), and encodes.

A call returns its answer's body, or raises: StoreError, a malformed key (MalformedKeys,
ValueError) or WireError(INVALID) become an error frame and the connection goes on.
GET and PUT move page bytes themselves, between the socket and the pool:

    GET: acquire (READ lease, never expires) -> header -> page bytes -> release (finally)
    PUT: reserve (RESERVE lease, never expires) -> page bytes into the slots -> commit;
         any failure before commit aborts, so no slot outlives the call. A put of up to
         256 KiB: page bytes into the connection's scratch -> stored in one step
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np

from kvstore_protocol import fastwire as fw
from kvstore_protocol.carriage import call_body_bytes
from kvstore_protocol.region import region_id

from ..auth import Principal
from ..rpc.calls import Calls
from ..rpc.carriage import Carriage
from ..rpc.limits import RequestLimits, request_message_bytes
from ..rpc.status import status_of
from ..store import Store
from ..store.layouts import LayoutInfo
from .io import (
    IOV_BATCH,
    SEND_BYTES,
    Reader,
    runs,
    runs_of,
    send_batch,
    send_file,
    send_slabs,
    send_views,
)

__all__ = ["SEND_SENDFILE", "SEND_SENDMSG", "Ops", "Session", "status_of"]

SEND_SENDFILE = "sendfile"
SEND_SENDMSG = "sendmsg"

# An aligned GET answer's header: the frame header, then ALIGN_PAD zero bytes of body.
_GET_HEAD = struct.Struct(fw.HEADER.format + f"{fw.ALIGN_PAD}x")
_ALIGNED_HEAD = _GET_HEAD.size
_GET = int(fw.Op.GET)


@dataclasses.dataclass(slots=True)
class Session:
    """One connection's state: its socket, who it acts for, the leases it holds."""

    sock: socket.socket
    reader: Reader                    # the socket's incoming bytes (a Put's pages)
    plain: bool                       # not TLS: sendmsg and sendfile may be used
    scratch: memoryview               # for the data of a refused Put; bounded
    # Who the request being served acts for: looked up again before every request
    # (connection.py), so an auth reload applies to open connections at once.
    who: Principal
    # What a Get answer's body holds before its pages: fastwire.ALIGN_PAD zero bytes for a
    # client that reads aligned answers (HELLO's ALIGNED), else nothing.
    pad: bytes = b""
    # Lease ids taken on this connection and not yet ended through it: released when it
    # closes, so a client that dies holding leases leaves no pin behind. Insertion-ordered
    # and capped (MAX_TRACKED): a client that lets its leases expire instead of ending
    # them would otherwise grow it without bound. An OrderedDict, whose oldest entry goes
    # in O(1): a dict's first key, found by iterating, is found past every entry deleted
    # before it, and at the cap each call dropped one more: past it, a leased lookup cost
    # a real server 52 µs of CPU against 44 with this (one CPU, the two side by side).
    leases: OrderedDict[int, None] = dataclasses.field(default_factory=OrderedDict)
    # An aligned Get answer's header and pad, packed in place for each Get (Ops.get).
    head: bytearray = dataclasses.field(default_factory=lambda: bytearray(_GET_HEAD.size))
    head_view: memoryview = dataclasses.field(init=False)

    # A small Get's answer sent under the store's lock (Ops.send_now, bound to this
    # session at HELLO where it applies), and the bytes of it such a send took when it
    # was cut short: the rest goes after its pages are pinned (Ops._send_few).
    now: Callable[[LayoutInfo, list[int]], bool] | None = None
    sent: int = 0

    def __post_init__(self) -> None:
        self.head_view = memoryview(self.head)

    def took(self, lease_id: int) -> None:
        if lease_id:
            self.leases[lease_id] = None
            if len(self.leases) > MAX_TRACKED:
                self.leases.popitem(last=False)


# The largest pins a LOOKUP answers (fastwire.PINS): beyond, it answers the count alone
# and the worker acquires. 2 MiB is 32 ranks of a 128k-token prompt in 16-token pages.
_MAX_PINS_BYTES = 2 << 20

# The largest Get answer sent under the store's lock (Ops.send_now): its send never waits
# for the peer, but the kernel copies it meanwhile, and every other call waits for the lock.
# A page or two of an engine's per-layer Get; larger ones are pinned and sent after.
NOW_BYTES = 128 << 10

# Leases a connection remembers; the oldest beyond this have long expired by their ttl.
MAX_TRACKED = 65536

# From this many bytes of pages a page-major Get to a client that does not read aligned
# answers (fastwire.ALIGNED, which removes the cause) sends its 24-byte header in a call
# of its own. In one sendmsg with the header the pages land 24 bytes off their source's
# alignment, and on some CPUs the kernel then copies them much slower; nothing the
# receiver does helps. A header alone costs the receiver an extra wake-up, which for
# small gets costs more than the copy saves, and a host where the alignment costs
# nothing gains nothing either way: so the split is made only from this size up, where
# it helped in side-by-side runs.
HEAD_ALONE_BYTES = 512 << 10


class Ops:
    """The calls over one store; shared by every connection."""

    def __init__(self, store: Store, auth_on: bool, send_mode: str = SEND_SENDMSG,
                 limits: RequestLimits | None = None,
                 carriage: Carriage | None = None) -> None:
        """limits: what one request may ask for; the gRPC service's own object, so both
        paths refuse the same requests with the same outcome and message. carriage: the
        unary calls CALL carries (rpc/carriage.py); None: CALLS is not granted."""
        self.store = store
        self.calls = Calls(store, auth_on, limits)
        self.send_mode = send_mode
        self.limits = self.calls.limits
        # The largest request body a connection reads (checked on the header).
        self.max_body = fw.request_body_bytes(self.limits.max_keys)
        self.carriage = carriage
        # A CALL's body: its name and the one message gRPC would take for it.
        self.max_call_body = call_body_bytes(request_message_bytes(self.limits.max_keys))
        self.mem = store.mem.data
        # Our own descriptor of the pool, for sendfile: a duplicate of the region's, since
        # with --shm-group the pool is a memfd and its path is the hand-out socket.
        self.pool_fd = store.region.dup_fd()
        self.region_id = region_id(store.region.token)

    def close(self) -> None:
        if self.pool_fd >= 0:
            os.close(self.pool_fd)
            self.pool_fd = -1

    # -- control ------------------------------------------------------------------------
    def lookup(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        ids, data, key_size, lease_ms = _lookup_body(body)
        if h.flags & fw.MISSED:
            # Answered 0 by the client itself (fastwire.MISSED): only counted.
            self.calls.count_misses(s.who, ids, data, key_size)
            return fw.COUNT_LEASE.pack(0, 0)
        found = self.calls.lookup(s.who, ids, data, key_size, lease_ms,
                                  pins=bool(h.flags & fw.PINS))
        answer = fw.COUNT_LEASE.pack(found.count, found.lease_id)
        offsets = found.offsets
        if not offsets or len(offsets) * found.count * 8 > _MAX_PINS_BYTES:
            s.took(found.lease_id)        # no pins answered: the lease is this caller's
            return answer
        # Not s.took: the pins are for a worker in another process, which reads the pages
        # under this lease after this connection may have closed (fastwire.PINS).
        return (answer + fw.PINS_HEAD.pack(self.region_id, int(found.ttl * 1000),
                                           len(offsets))
                + b"".join(fw.u64(o) for o in offsets))

    def exists(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        layout_id, key_size, keys = fw.decode_layout_keys(body)
        present = self.calls.exists(s.who, layout_id, keys, key_size)
        return fw.COUNT.pack(len(present)) + np.packbits(present, bitorder="little").tobytes()

    def delete(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        layout_id, key_size, keys = fw.decode_layout_keys(body)
        return fw.COUNT.pack(self.calls.delete(s.who, layout_id, keys, key_size))

    def acquire(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        layout_id, token, lease_ms = _unpack(fw.LEASED_HEAD, body, 0)
        block, _ = fw.decode_keys(body, fw.LEASED_HEAD.size)
        pinned = self.calls.acquire(s.who, layout_id, block.data, _size(block), token,
                                    lease_ms)
        s.took(pinned.lease_id)
        return fw.LEASE.pack(pinned.lease_id) + fw.u64(pinned.offsets)

    def reserve(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        layout_id, token, lease_ms = _unpack(fw.LEASED_HEAD, body, 0)
        block, _ = fw.decode_keys(body, fw.LEASED_HEAD.size)
        res = self.calls.reserve(s.who, layout_id, block.data, _size(block), token,
                                 lease_ms)
        s.took(res.lease_id)
        return fw.RESERVED.pack(res.lease_id, res.skipped, res.in_flight) + fw.u64(res.offsets)

    def commit(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        (lease_id,) = _lease_body(body, "COMMIT")
        s.leases.pop(lease_id, None)
        return fw.LEASE.pack(self.calls.commit(s.who, lease_id))

    def abort(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        (lease_id,) = _lease_body(body, "ABORT")
        s.leases.pop(lease_id, None)
        return fw.LEASE.pack(int(self.calls.abort(s.who, lease_id)))

    def release(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        # The pages read under it, where the client says (a longer body: fastwire.READ).
        if len(body) == fw.LEASE.size + fw.READ.size:
            lease_id, read = _LEASE_READ.unpack(body)
        else:
            (lease_id,), read = _lease_body(body, "RELEASE", fw.READ.size), 0
        s.leases.pop(lease_id, None)
        return fw.LEASE.pack(int(self.calls.release(s.who, lease_id, read)))

    def call(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        """A unary call carried whole (kvstore_server.rpc.carriage), as this connection's
        tenant."""
        if self.carriage is None:          # not granted at HELLO: the client knew
            raise fw.WireError("CALL was not granted on this connection",
                               fw.Status.UNIMPLEMENTED)
        return self.carriage.serve(s.who, body)

    # -- page bytes ---------------------------------------------------------------------
    def get(self, s: Session, h: fw.Header, body: memoryview) -> None:
        """Answers itself: the header, then the pages straight out of the pool."""
        layout_id, key_size, keys = fw.decode_layout_keys(body)
        order = h.flags
        if order == fw.PAGE_MAJOR and s.pad and s.plain and self.send_mode == SEND_SENDMSG:
            # The common Get, a page or a block of pages in DRAM to a client that reads
            # aligned answers: pinned and sent with no arrays (store/few_reads.py).
            few = self.calls.get_few(s.who, layout_id, keys, key_size, s.now)
            if few is not None:
                if few[1]:                  # pinned: not sent whole under the lock
                    self._send_few(s, *few)
                return
        if order != fw.PAGE_MAJOR and order != fw.LAYER_MAJOR:
            raise fw.WireError(f"unknown GET order {order}", fw.Status.INVALID)
        reading = self.calls.get(s.who, layout_id, keys, key_size)
        try:
            pinned = reading.pinned
            info = pinned.info
            pb = info.page_bytes
            offsets = pinned.offsets
            n = len(offsets)
            nbytes = n * pb
            if s.plain and self.send_mode == SEND_SENDMSG and s.pad and nbytes <= SEND_BYTES \
                    and (order == fw.PAGE_MAJOR or info.layout.num_layers == 1):
                # The common case, and an engine's per-layer one: the header and every
                # run of pages in one sendmsg, which the kernel takes whole (a one-page
                # get is one system call), aligned (s.pad), with no per-call objects
                # but the pages' views.
                _GET_HEAD.pack_into(s.head, 0, fw.MAGIC, fw.VERSION, _GET, 0, 0, fw.ALIGN_PAD,
                                    nbytes)
                mem = self.mem
                offs = offsets.tolist()
                first = offs[0] if n else 0
                if offs == list(range(first, first + nbytes, pb)):
                    # One run (a page, or pages stored side by side, as a Put's are):
                    # one view, found with one compare in C, not runs()'s walk.
                    batch = [s.head_view, mem[first:first + nbytes]]
                else:
                    batch = [s.head_view]
                    batch += [mem[off:off + (j - i) * pb] for i, j, off in runs(offsets, pb)]
                if len(batch) <= IOV_BATCH:
                    sent = s.sock.sendmsg(batch)
                    if sent != nbytes + _ALIGNED_HEAD:
                        # Sent in part (a timeout cut it short): the rest, from where it
                        # stopped.
                        send_batch(s.sock, batch, sent)
                    return
                self._send_views(s, batch)
                return
            self._send_get(s, order, info, offsets, nbytes)
        finally:
            reading.__exit__(None, None, None)      # releases the pins

    def _send_few(self, s: Session, info: LayoutInfo, slots: list[int],
                  offs: list[int]) -> None:
        """A Calls.get_few's pages: the aligned header and every run of pages in one
        sendmsg (up to SEND_BYTES; the kernel takes it whole, so a one-page Get is one
        system call), then the pins go. They stay until every byte is sent: a sendmsg cut
        short by a slow reader is resumed from where it stopped, under the same pins."""
        try:
            pb = info.page_bytes
            nbytes = len(offs) * pb
            _GET_HEAD.pack_into(s.head, 0, fw.MAGIC, fw.VERSION, _GET, 0, 0, fw.ALIGN_PAD,
                                nbytes)
            mem = self.mem
            first = offs[0]
            if len(offs) == 1 or offs == list(range(first, first + nbytes, pb)):
                batch = [s.head_view, mem[first:first + nbytes]]     # one run: one view
            else:
                batch = [s.head_view]
                batch += [mem[off:off + (j - i) * pb] for i, j, off in runs_of(offs, pb)]
            if nbytes > SEND_BYTES:
                send_views(s.sock, batch)
                return
            sent, s.sent = s.sent, 0
            if sent:                                # send_now took a part: the rest
                send_batch(s.sock, batch, sent)
                return
            sent = s.sock.sendmsg(batch)
            if sent != nbytes + _ALIGNED_HEAD:
                send_batch(s.sock, batch, sent)     # sent in part: the rest
        finally:
            self.store.unpin_few(slots)

    def send_now(self, s: Session, info: LayoutInfo, offs: list[int]) -> bool:
        """Under the store's lock (store/few_reads.py): a Get answer of one run of pages, up
        to NOW_BYTES, in one sendmsg that never waits (MSG_DONTWAIT). True when the kernel
        took it whole: its pages need no pin. Else s.sent says how much it took, and the
        caller pins the pages and sends the rest (_send_few)."""
        pb = info.page_bytes
        nbytes = len(offs) * pb
        first = offs[0]
        if nbytes > NOW_BYTES or (len(offs) > 1 and
                                  offs != list(range(first, first + nbytes, pb))):
            return False
        _GET_HEAD.pack_into(s.head, 0, fw.MAGIC, fw.VERSION, _GET, 0, 0, fw.ALIGN_PAD, nbytes)
        try:
            sent = s.sock.sendmsg([s.head_view, self.mem[first:first + nbytes]], (),
                                  socket.MSG_DONTWAIT)
        except BlockingIOError:                     # no room at all: pinned, then sent
            return False
        if sent == nbytes + _ALIGNED_HEAD:
            return True
        s.sent = sent
        return False

    def _send_get(self, s: Session, order: int, info: LayoutInfo, offsets: np.ndarray,
                  nbytes: int) -> None:
        """A Get's answer where get's one sendmsg does not fit it: layer-major, sendfile,
        TLS, past SEND_BYTES, or to a client that does not read aligned answers."""
        pb = info.page_bytes
        head = fw.encode_header(fw.Op.GET, len(s.pad), nbytes) + s.pad
        if order == fw.LAYER_MAJOR and info.layout.num_layers > 1:
            s.sock.sendall(head)
            self._send_layers(s, offsets, pb, info.layer_bytes, info.layout.num_layers)
        elif s.plain and self.send_mode == SEND_SENDFILE:
            s.sock.sendall(head)
            for i, j, off in runs(offsets, pb):
                send_file(s.sock, self.pool_fd, off, (j - i) * pb)
        else:
            if len(offsets) == 1:                   # no runs to find
                off = int(offsets[0])
                pages = [self.mem[off:off + pb]]
            else:
                pages = [self.mem[off:off + (j - i) * pb]
                         for i, j, off in runs(offsets, pb)]
            if s.plain and len(pages) < IOV_BATCH and nbytes <= SEND_BYTES and (
                    s.pad or nbytes < HEAD_ALONE_BYTES):
                # The header and every run of pages in one sendmsg: a small get to a
                # client that does not read aligned answers.
                send_batch(s.sock, [memoryview(head), *pages])
            elif s.pad or nbytes < HEAD_ALONE_BYTES:
                self._send_views(s, [memoryview(head), *pages])
            else:
                # Large, to a client that does not read aligned answers: the header
                # alone, so the pages keep their alignment (HEAD_ALONE_BYTES).
                s.sock.sendall(head)
                self._send_views(s, pages)

    def _send_layers(self, s: Session, offsets: np.ndarray, pb: int, lb: int,
                     layers: int) -> None:
        """Each layer's slab of every page, layer after layer, as one stream of views:
        each sendmsg holds slabs across layers (it was one sendmsg per layer: 32 for 8
        pages of 32 layers, now 1), and no more than about one call's views are alive
        at once (send_slabs; send_views for TLS or a slab larger than a call)."""
        mem = self.mem
        if s.plain and lb <= SEND_BYTES:
            send_slabs(s.sock, mem, offsets, layers, lb)
            return
        offs = offsets.tolist()
        self._send_views(s, (mem[off + base:off + base + lb]
                             for base in range(0, layers * lb, lb) for off in offs))

    def _send_views(self, s: Session, views: Iterable[memoryview]) -> None:
        if s.plain:
            send_views(s.sock, views)
        else:                    # TLS: an SSLSocket has no sendmsg
            for view in views:
                s.sock.sendall(view)

    def put(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        """Receives the data into reserved slots, or drains it when the put is refused,
        so the connection stays in step either way."""
        if h.data_len <= len(s.scratch):
            return self._put_small(s, h, body)
        try:
            layout_id, key_size, keys = fw.decode_layout_keys(body)
            writing = self.calls.put(s.who, layout_id, keys, key_size, data_len=h.data_len)
        except Exception:
            s.reader.skip(h.data_len, s.scratch)
            raise
        with writing:
            res, pb = writing.reservation, writing.page_bytes
            mem = self.mem
            for i, j, off in runs(res.offsets, pb):
                if off < 0:              # already stored: skip its bytes
                    s.reader.skip((j - i) * pb, s.scratch)
                else:
                    s.reader.read_into(mem[off:off + (j - i) * pb])
            stored = writing.commit()
        return fw.PUT_DONE.pack(stored, res.skipped, res.in_flight)

    # A put of a few pages (up to the connection's scratch, 256 KiB): its bytes are
    # received first, into the scratch, then stored in one step (Store.put_bytes: one
    # hold of the store's lock, no lease). Reserve, receive into the slots and commit
    # held the lock twice and granted and ended a lease, most of a one-page put's server
    # Python: measured in process, a 64 KiB one's fell by a fifth, the extra copy
    # included. The memory is bounded before the bytes come: the scratch is the
    # connection's, whatever the request declares; and nothing is held while they come.
    def _put_small(self, s: Session, h: fw.Header, body: memoryview) -> bytes:
        """A put whose data fits the scratch: received whole, then stored or refused."""
        pages = s.scratch[:h.data_len]
        s.reader.read_into(pages)
        layout_id, key_size, keys = fw.decode_layout_keys(body)
        stored, skipped, in_flight = self.calls.put_bytes(s.who, layout_id, keys, key_size,
                                                          pages)
        return fw.PUT_DONE.pack(stored, skipped, in_flight)


# A LOOKUP body of one layout (an engine's: its rank's) up to its keys, in one unpack.
_ONE_LAYOUT_LOOKUP = fw.ONE_LAYOUT_LOOKUP


def _lookup_body(body: memoryview) -> tuple[list[bytes], bytes, int, int]:
    """(layout ids, packed keys, one key's size as the calls take it, lease_ms) of a
    LOOKUP body; WireError(INVALID) as decode_keys where it is malformed."""
    if len(body) >= _ONE_LAYOUT_LOOKUP.size:
        lease_ms, n_layouts, layout_id, key_size, n = _ONE_LAYOUT_LOOKUP.unpack_from(body)
        end = _ONE_LAYOUT_LOOKUP.size + n * key_size
        if n_layouts == 1 and 1 <= key_size <= fw.MAX_KEY_BYTES and end <= len(body):
            return ([layout_id], bytes(body[_ONE_LAYOUT_LOOKUP.size:end]),
                    key_size if n else 0, lease_ms)
    lease_ms, n_layouts = _unpack(fw.LOOKUP_HEAD, body, 0)
    if n_layouts > fw.MAX_LAYOUTS:
        raise fw.WireError(f"lookup names {n_layouts} layouts; at most "
                           f"{fw.MAX_LAYOUTS}", fw.Status.INVALID)
    pos = fw.LOOKUP_HEAD.size
    end = pos + 16 * n_layouts
    if end > len(body):
        raise fw.WireError("body ends inside its layout ids", fw.Status.INVALID)
    ids = [bytes(body[i:i + 16]) for i in range(pos, end, 16)]
    block, _ = fw.decode_keys(body, end)
    return ids, block.data, _size(block), lease_ms


def _size(block: fw.KeysBlock) -> int:
    """One key's size as the calls take it: 0 with no keys (an unset size)."""
    return block.key_size if block.n else 0


_LEASE_READ = struct.Struct("<" + fw.LEASE.format.lstrip("<") + fw.READ.format.lstrip("<"))


# A lease id's body is that and nothing more. Bytes past it were read and ignored, so a
# frame that lied about its op or its length was served as if well formed.
def _lease_body(body: memoryview, op: str, extra: int = 0) -> tuple:
    """The lease id of a COMMIT's, ABORT's or RELEASE's body; extra: the length of the
    longer form the op also takes (a RELEASE's pages read)."""
    if len(body) != fw.LEASE.size:
        longer = f" or {fw.LEASE.size + extra} (and the pages read)" if extra else ""
        raise fw.WireError(f"a {op} body is {fw.LEASE.size} bytes (a lease id){longer}, "
                           f"not {len(body)}", fw.Status.INVALID)
    return fw.LEASE.unpack(body)


def _unpack(st, body: memoryview, pos: int) -> tuple:
    if len(body) < pos + st.size:
        raise fw.WireError(f"body of {len(body)} bytes is too short for this op "
                           f"(needs {pos + st.size})", fw.Status.INVALID)
    return st.unpack_from(body, pos)


# The calls that answer with a body; GET answers by itself.
def table(ops: Ops) -> dict[int, Callable]:
    return {fw.Op.LOOKUP: ops.lookup, fw.Op.EXISTS: ops.exists, fw.Op.DELETE: ops.delete,
            fw.Op.ACQUIRE: ops.acquire, fw.Op.RESERVE: ops.reserve, fw.Op.COMMIT: ops.commit,
            fw.Op.ABORT: ops.abort, fw.Op.RELEASE: ops.release, fw.Op.PUT: ops.put,
            fw.Op.GET: ops.get, fw.Op.CALL: ops.call}
