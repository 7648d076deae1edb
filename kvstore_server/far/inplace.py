"""A glide batch whose replies are read where glide's core left them, not copied out.

glide_sync's `exec` turns a batch's reply into Python objects: every bulk string is
copied from the reply glide's Rust core holds into a new `bytes`, and the core's copy
freed. A far read then verifies that `bytes` (codec.py) and copies it again into a pool
slot: two copies of each page after glide's core has it, and an allocation. Reading the
reply in place, through cffi views of the core's own buffers, drops the middle copy and
its allocation: verify, then copy once into the slot, then free the core's reply.

Side by side in one process (FarTier.read_into of 1 MiB pages, interleaved rounds) it
saved wall and CPU time; for 64 KiB pages it made no difference. Through two servers:
reads.py.

This leans on glide_sync's internals (the client's `_lib`, `_ffi`, `_core_client`, the
batch and options converters `exec` uses, the CommandResponse layout of glide 2.6):
`supported` checks the release and that they are there, and callers fall back to
`exec` when not. The views handed out are valid only until the caller frees the reply: whatever
is wanted from a value is copied before that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import metadata

import glide_sync as glide
from glide_shared.exceptions import get_request_error_class

__all__ = ["make_batch", "run", "supported"]

# CommandResponse.response_type, as glide_sync 2.6's BaseClient._handle_command_response
# reads it.
_NULL, _INT, _STRING, _ARRAY, _OK, _ERROR = 0, 1, 4, 5, 8, 9

# The glide_sync releases whose internals this was written against and tested with. A
# later release may keep the names and change what they mean (the arguments of the
# core's `batch`): it reads through exec until this module is checked against it.
_RELEASES = ("2.6.",)

_NEEDED = ("_ffi", "_lib", "_core_client", "_is_closed", "_convert_commands_to_c_batch_info",
           "_create_c_batch_options_from_params")


_FIELDS = {"CommandResult": {"response", "command_error"},
           "CommandError": {"command_error_message", "command_error_type"},
           "CommandResponse": {"response_type", "int_value", "string_value",
                               "string_value_len", "array_value", "array_value_len"}}


def supported(client) -> bool:
    """Whether this glide client exposes what an in-place read needs, the reply's
    structures included (a glide that changed them falls back to exec, not to errors)."""
    try:
        return (metadata.version("valkey-glide-sync").startswith(_RELEASES)
                and all(hasattr(client, name) for name in _NEEDED)
                and hasattr(client._lib, "batch")
                and hasattr(client._lib, "free_command_result")
                and all(fields <= {name for name, _ in client._ffi.typeof(struct).fields}
                        for struct, fields in _FIELDS.items()))
    except Exception:   # noqa: BLE001 - cffi says an unknown type in its own ways
        return False


def make_batch(client, commands: Sequence[list]):
    """`commands` as one non-atomic glide batch, of the kind `client` runs."""
    cluster = isinstance(client, glide.GlideClusterClient)
    batch = glide.ClusterBatch(False) if cluster else glide.Batch(False)
    for args in commands:
        batch.custom_command([*args])
    return batch


def run(client, commands: Sequence[list], timeout_ms: int) -> tuple[list, Callable[[], None]]:
    """Run `commands` as one non-atomic batch, as `exec(batch, raise_on_error=False)`
    does: one result per command, an array as a list, a failed command as a
    RequestError, but a bulk string as a writable view into glide's reply. The caller
    calls the returned free() once, when done with the views (they are invalid after
    it). Raises glide's errors where `exec` would (closed client, timeout, no
    connection), having freed what there was."""
    batch = make_batch(client, commands)
    ffi, lib = client._ffi, client._lib
    if client._is_closed or client._core_client == ffi.NULL:
        raise glide.ClosingError("Unable to execute requests; the client is closed.")
    # both return (cdata, refs): the refs keep the arguments' memory alive for the call
    info, refs = client._convert_commands_to_c_batch_info(batch.commands, False)
    options, option_refs = client._create_c_batch_options_from_params(False, False, None,
                                                                      timeout_ms)
    result = lib.batch(client._core_client, 0, info, False, options, 0)
    del refs, option_refs
    if result == ffi.NULL:
        raise glide.ClosingError("Internal error: received NULL as a batch result")
    try:
        if result.command_error != ffi.NULL:
            error = result.command_error
            raise get_request_error_class(error.command_error_type)(
                ffi.string(error.command_error_message).decode("utf-8", "replace"))
        top = _value(ffi, result.response)
    except BaseException:
        lib.free_command_result(result)
        raise
    freed: list[bool] = []

    def free() -> None:
        if not freed:
            freed.append(True)
            lib.free_command_result(result)

    return (top if isinstance(top, list) else []), free


def _value(ffi, r):
    kind = r.response_type
    if kind == _STRING:
        return ffi.buffer(r.string_value, r.string_value_len)
    if kind == _NULL:
        return None
    if kind == _ARRAY:
        return [_value(ffi, r.array_value[i]) for i in range(r.array_value_len)]
    if kind == _ERROR:
        return glide.RequestError(bytes(ffi.buffer(r.string_value, r.string_value_len))
                                  .decode("utf-8", "replace"))
    if kind == _INT:
        return r.int_value
    if kind == _OK:
        return "OK"
    return glide.RequestError(f"reply of unexpected type {kind}")
