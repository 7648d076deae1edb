"""kvstore-admin: look at and operate a running kvstore-server from a shell.

    kvstore-admin [--server ADDR] [--timeout S] [--token T] [--tls-ca PEM
                  [--tls-cert PEM --tls-key PEM]] COMMAND
        stats [--json] [--watch SECONDS]      tiers, layouts, leases, uptime
        layouts [--json]                      registered layouts
        evict (--layout ID | --bytes SIZE | --all) [--tier dram|disk|far|all] [--force]
        clear [--yes] [--force]               delete every page (asks first on a terminal)
        invalidate (--model M [--revision R] | --layout ID | --tenant T)
                                              delete a scope's pages from every tier, the
                                              far tier's of the whole fleet
        inspect --layout ID KEYHEX            where one page is and how it is used
        health [--service disk]               grpc.health.v1 Check; exit 0 only when SERVING

A layout ID may be any unique prefix of its hex id, as git accepts short hashes. Human
output uses binary units (KiB, MiB); `--json` prints integers for bytes and hex for ids.
`stats --watch --json` prints one object per line (JSON Lines). A server with an auth
file needs an admin token: `--token` or, better (flags show in `ps`), $KVSTORE_TOKEN.
Exit status: 0 done,
1 failed (server unreachable or refusing, not SERVING, clear declined, or an evict, clear
or invalidate that did not reach every tier or every master of the far tier's cluster:
the message says what it removed, and the server finishes it in the background), 2 bad
usage.
Every failure is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tabulate import tabulate

from kvstore_protocol.units import format_size, parse_size

from .admin import plain
from .channel import open_channel
from .client import KVStoreClient
from .errors import KVStoreError

__all__ = ["main"]

PROG = "kvstore-admin"
DEFAULT_SERVER = "127.0.0.1:50051"

class _Fail(Exception):
    """A failure to report as one line on stderr (exit status 1)."""


# -- parsing and formatting ---------------------------------------------------------
def _positive(parse, what: str, least: float = 0.0, most: float = 86_400.0):
    """An argparse type: parse(text), which must give a number above zero, at least
    `least` and at most `most` (a day): a timeout of 1e300 s overflowed gRPC's deadline
    and failed at once, a --watch of 1e-300 s asked the server in a busy loop."""
    def check(text: str):
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{what} must be above zero, got {text!r}")
        if not least <= value <= most:
            low = f"at least {least:g}" if least else "above zero"
            raise argparse.ArgumentTypeError(f"{what} must be {low} and at most {most:g}, "
                                             f"got {text!r}")
        return value
    return check


def _layout_prefix(text: str) -> str:
    text = text.lower().removeprefix("0x")
    if not re.fullmatch(r"[0-9a-f]{1,32}", text):
        raise argparse.ArgumentTypeError(f"a layout id is up to 32 hex digits, got {text!r}")
    return text


def _key(text: str) -> bytes:
    text = text.lower().removeprefix("0x")
    if not re.fullmatch(r"(?:[0-9a-f]{2}){1,64}", text):
        raise argparse.ArgumentTypeError(f"a key is 1 to 64 bytes as hex digits, got {text!r}")
    return bytes.fromhex(text)


_human = format_size


def _ratio(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _duration(seconds: float) -> str:
    s = int(seconds)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return (f"{d}d " if d else "") + (f"{h}h " if d or h else "") + f"{m}m {s % 60}s"


def _emit(args: argparse.Namespace, data, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text, flush=True)


# -- commands -----------------------------------------------------------------------
def _table(rows: list, headers: list[str], text_columns: int) -> str:
    """Text columns on the left, numbers right-aligned. No number parsing: a hex id made
    of digits only, or with one "e", would otherwise be printed as a float."""
    align = ["left"] * text_columns + ["right"] * (len(headers) - text_columns)
    return tabulate(rows, headers=headers, colalign=align, disable_numparse=True)


def _render_stats(resp) -> str:
    # "served" is pages read from the store (Acquire, Get); "lookup hits" counts a page
    # each time it is looked up, and an engine looks a waiting request up at every step,
    # so the two differ many times over and only the first is a cache's hits.
    tiers = [[t.name, "FAILED" if t.failed else (t.state or "ok"),
              _human(t.capacity_bytes), _human(t.used_bytes),
              _ratio(t.used_bytes, t.capacity_bytes), t.pages,
              t.served if t.name == "dram" else "-", t.hits, t.misses,
              _ratio(t.hits, t.hits + t.misses), t.evictions, _human(t.bytes_in),
              _human(t.bytes_out)] for t in resp.tiers]
    layouts = [[s.layout_id.hex(), s.layout.model, s.layout.dtype, s.layout.num_layers,
                s.layout.page_tokens, f"{s.layout.tp_rank}/{s.layout.tp_size}",
                _human(s.page_bytes), s.pages, _human(s.used_bytes), s.served, s.hits,
                s.misses, s.evictions] for s in resp.layouts]
    # Tenants only where there is more than the one built-in tenant of a server
    # without auth, or a quota.
    tenants = [[t.name, _human(t.used_bytes), _human(t.quota_bytes) if t.quota_bytes else "-",
                _ratio(t.used_bytes, t.quota_bytes), t.pages] for t in resp.tenants]
    show_tenants = len(resp.tenants) > 1 or any(t.quota_bytes for t in resp.tenants)
    return "\n\n".join(part for part in (
        (f"kvstore-server {resp.version}   uptime {_duration(resp.uptime_seconds)}   "
         f"leases {resp.leases}   leased pages {resp.leased_pages}"
         + (f"   held back {resp.held_back_pages} pages (of {resp.held_back_leases} "
            "expired leases)" if resp.held_back_pages else "")
         + (f"   retained {resp.retained_pages} pages (of {resp.retention_sessions} "
            "sessions)" if resp.retention_sessions else "")
         + (f"   retains refused {resp.retention_refused}" if resp.retention_refused
            else "")),
        _table(tiers, ["tier", "state", "capacity", "used", "use %", "pages", "served",
                       "lookup hits", "lookup misses", "lookup hit rate", "evictions",
                       "bytes in", "bytes out"], 2),
        "\n".join(f"far tier: {t.reads} pages read, {t.writes} written, {t.drops} dropped "
                  f"(queue full), {t.corrupt} values refused, {t.errors} errors"
                  for t in resp.tiers if t.name == "far"),
        "\n".join(f"{t.name} tier FAILED: it takes no more pages (a write failed: disk full "
                  "or failing; the server log says which); pages on it are still read"
                  for t in resp.tiers if t.failed),
        _table(layouts, ["layout id", "model", "dtype", "layers", "page tokens", "tp",
                         "page bytes", "pages", "used", "served", "lookup hits",
                         "lookup misses", "evictions"], 3)
        if layouts else "(no layouts registered)",
        _table(tenants, ["tenant", "used", "quota", "use %", "pages"], 1)
        if show_tenants else "") if part)


def cmd_stats(client: KVStoreClient, args: argparse.Namespace) -> int:
    while True:
        resp = client.stats()
        if args.json:
            print(json.dumps(plain(resp), indent=None if args.watch else 2), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")
            elif args.watch:
                print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
            print(_render_stats(resp), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


def cmd_layouts(client: KVStoreClient, args: argparse.Namespace) -> int:
    layouts = client.list_layouts()
    rows = [[s.layout_id.hex(), s.layout.model, s.layout.revision, s.layout.dtype,
             s.layout.salt, s.layout.num_layers, s.layout.page_tokens, s.layout.num_kv_heads,
             s.layout.head_size, s.layout.kv_factor, f"{s.layout.tp_rank}/{s.layout.tp_size}",
             s.layout.pp_rank, _human(s.page_bytes), s.pages] for s in layouts]
    _emit(args, [plain(s) for s in layouts], _table(
        rows, ["layout id", "model", "revision", "dtype", "salt", "layers", "page tokens", "kv heads",
               "head size", "kv factor", "tp", "pp", "page bytes", "pages"], 4)
        if rows else "(no layouts registered)")
    return 0


def _resolve_layout(client: KVStoreClient, prefix: str) -> bytes:
    """The id of the one registered layout whose hex id starts with prefix."""
    ids = [s.layout_id for s in client.list_layouts() if s.layout_id.hex().startswith(prefix)]
    if not ids:
        raise _Fail(f"no layout {prefix} on {client.address} (see `{PROG} layouts`)")
    if len(ids) > 1:
        raise _Fail(f"layout prefix {prefix} is ambiguous: it matches {len(ids)} layouts")
    return ids[0]


def cmd_evict(client: KVStoreClient, args: argparse.Namespace) -> int:
    if args.layout is not None:
        resp = client.evict(layout_id=_resolve_layout(client, args.layout), tier=args.tier,
                            force=args.force)
    elif args.bytes is not None:
        resp = client.evict(nbytes=args.bytes, tier=args.tier, force=args.force)
    else:
        resp = client.evict(everything=True, tier=args.tier, force=args.force)
    _emit(args, plain(resp), f"evicted {resp.pages} pages ({_human(resp.bytes)}); "
                              f"{resp.skipped_leased} leased pages left in place"
                              + (f"; {resp.leases_broken} leases broken" if args.force else ""))
    return 0


def cmd_clear(client: KVStoreClient, args: argparse.Namespace) -> int:
    if not args.yes:
        if not sys.stdin.isatty():
            raise _Fail("clear deletes every page: pass --yes (stdin is not a terminal)")
        pages = sum(t.pages for t in client.stats().tiers)
        try:
            answer = input(f"Delete all {pages} pages on {client.address}? [y/N] ")
        except EOFError:                    # Ctrl-D: no
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("not cleared")
            return 1
    resp = client.clear(force=args.force)
    _emit(args, plain(resp), f"cleared {resp.pages} pages of {resp.layouts} layouts"
                              + (f"; {resp.leases_broken} leases broken" if args.force else ""))
    return 0


def cmd_invalidate(client: KVStoreClient, args: argparse.Namespace) -> int:
    layout_id = b""
    if args.layout is not None:
        # A whole id may name a layout only other servers (the far tier) know of.
        layout_id = (bytes.fromhex(args.layout) if len(args.layout) == 32
                     else _resolve_layout(client, args.layout))
    resp = client.admin.invalidate(model=args.model or "", revision=args.revision or "",
                                   layout_id=layout_id, tenant=args.tenant or "")
    _emit(args, plain(resp), f"invalidated {len(resp.layout_ids)} layouts: "
                              f"{resp.dram_pages} pages from DRAM, {resp.disk_pages} from "
                              f"disk, {resp.far_pages} from the far tier")
    return 0


def cmd_inspect(client: KVStoreClient, args: argparse.Namespace) -> int:
    layout_id = _resolve_layout(client, args.layout)
    resp = client.inspect(layout_id, args.key)
    rows = [("layout id", layout_id.hex()), ("key", args.key.hex()), ("tier", resp.tier),
            ("state", resp.state), ("size", f"{_human(resp.size_bytes)} ({resp.size_bytes} B)"),
            ("age", f"{resp.age_seconds:.1f}s"), ("idle", f"{resp.idle_seconds:.1f}s"),
            ("leases", resp.leases), ("slot offset", resp.slot_offset)]
    _emit(args, {"layout_id": layout_id.hex(), "key": args.key.hex(), **plain(resp)},
          tabulate(rows, tablefmt="plain", disable_numparse=True))
    return 0


def cmd_health(address: str, args: argparse.Namespace) -> int:
    with open_channel(address, **_tls(args)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=args.service),
                              timeout=args.timeout)
        except grpc.RpcError as exc:
            raise KVStoreError(exc.code(), exc.details() or "", "Check") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


# -- entry point --------------------------------------------------------------------
def _tls(args: argparse.Namespace) -> dict:
    return {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key}


def _version() -> str:
    try:
        return importlib.metadata.version("kvstore")
    except importlib.metadata.PackageNotFoundError:     # run from a checkout, not installed
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Look at and operate a kvstore-server.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("--server", default=os.environ.get("KVSTORE_SERVER", DEFAULT_SERVER),
                   metavar="ADDR",
                   help="host:port (default: $KVSTORE_SERVER or %(default)s)")
    p.add_argument("--timeout", type=_positive(float, "--timeout"), default=5.0,
                   metavar="S", help="seconds per call (default: %(default)s)")
    p.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN") or None, metavar="T",
                   help="admin bearer token of a server with --auth-file (default: "
                        "$KVSTORE_TOKEN, which unlike a flag does not show in ps)")
    p.add_argument("--tls-ca", metavar="PEM", help="CA certificate of the server's: use TLS")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate, for mutual TLS")
    p.add_argument("--tls-key", metavar="PEM", help="key of --tls-cert")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run, text: str, json_flag: bool = True) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=text, description=text)
        if json_flag:
            s.add_argument("--json", action="store_true", help="print JSON")
        s.set_defaults(run=run)
        return s

    s = command("stats", cmd_stats, "tiers, layouts, leases and uptime")
    s.add_argument("--watch", type=_positive(float, "SECONDS", least=0.1), metavar="SECONDS",
                   help="print again every SECONDS until Ctrl-C")
    command("layouts", cmd_layouts, "registered layouts")
    s = command("evict", cmd_evict, "evict unleased pages (DRAM pages move to disk, if any)")
    s.add_argument("--tier", choices=["dram", "disk", "far", "all"], default="dram",
                   help="which tier to evict from (default dram); far: this server's "
                        "namespace only, exit 1 if a master of the cluster did not answer")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--layout", type=_layout_prefix, metavar="ID", help="every page of a layout")
    what.add_argument("--bytes", type=_positive(parse_size, "SIZE"), metavar="SIZE",
                      help="at least SIZE (e.g. 512MiB), least recently used first")
    what.add_argument("--all", action="store_true", help="every page")
    force = ("first end every lease and reservation that clients hold (clients that died "
             "holding them), and every session's retention; a client still copying may "
             "then read a reused slot")
    s.add_argument("--force", action="store_true", help=force)
    s = command("clear", cmd_clear, "delete every page of every layout")
    s.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    s.add_argument("--force", action="store_true", help=force)
    s = command("invalidate", cmd_invalidate,
                "delete every page of a model, layout or tenant from DRAM, disk and the "
                "far tier (the far tier's of the whole fleet); exit 1 if a tier could not "
                "be reached or did not finish")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", metavar="M", help="every layout of this model")
    what.add_argument("--layout", type=_layout_prefix, metavar="ID",
                      help="one layout (a whole id, or a prefix of a layout of this server)")
    what.add_argument("--tenant", metavar="T", help="every layout of this tenant")
    s.add_argument("--revision", metavar="R",
                   help="with --model: only this revision (the layouts' revision, as "
                        "`layouts` lists it; a layout without one: its salt)")
    s = command("inspect", cmd_inspect, "where one key's page is and how it is used")
    s.add_argument("--layout", type=_layout_prefix, metavar="ID", required=True)
    s.add_argument("key", type=_key, metavar="KEYHEX")
    s = command("health", None, "grpc.health.v1 Check; exit 0 only when SERVING", False)
    s.add_argument("--service", default="",
                   help="service name (default: the server); `disk`: the disk tier, "
                        "NOT_SERVING once its writes failed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.run is None:
            return cmd_health(args.server, args)
        with KVStoreClient(args.server, timeout=args.timeout, retries=1, token=args.token,
                           **_tls(args)) as client:
            return args.run(client, args)
    except KeyboardInterrupt:
        # Ctrl-C is how --watch ends; anywhere else it still is no error worth a trace.
        return 0 if getattr(args, "watch", None) else 130
    except BrokenPipeError:
        # The reader went away (`stats --watch | head`): stop quietly, as cat does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError) as exc:       # an unreadable PEM file, a bad token
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except _Fail as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
    except KVStoreError as exc:
        if exc.code == grpc.StatusCode.UNAVAILABLE:
            print(f"{PROG}: cannot reach {args.server}: {exc.message}", file=sys.stderr)
        elif exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            print(f"{PROG}: {args.command}: no answer from {args.server} within "
                  f"{args.timeout:g}s (--timeout)", file=sys.stderr)
        else:
            print(f"{PROG}: {args.command} failed: {exc.code.name}: {exc.message}",
                  file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
