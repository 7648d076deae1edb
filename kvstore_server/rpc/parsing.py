"""Request bytes to messages without raising, so bytes that do not parse get INVALID_ARGUMENT.

gRPC Python answers INTERNAL ("Exception deserializing request!") when a request
deserializer raises, and logs a traceback for every such request. INTERNAL means a
server defect, and every bad input is promised a status that says what was wrong
(docs/architecture.md, "Serving and running"). So the deserializers made here never raise: bytes that do not parse become an
`Unparsed` placeholder, and `checked` (called by `service.guarded`, inside its mapping
of exceptions to codes) turns it into `MalformedRequest`, a ValueError, hence
INVALID_ARGUMENT with the parser's reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.message import Message

__all__ = ["MalformedRequest", "Unparsed", "checked", "parser"]


class MalformedRequest(ValueError):
    """The request's bytes are not a valid message of the method's request type."""


@dataclasses.dataclass(frozen=True, slots=True)
class Unparsed:
    """Stands in for a request whose bytes did not parse; `reason` says why."""

    reason: str


def parser(message_type: type[Message]) -> Callable[[bytes], Any]:
    """A request deserializer for message_type that returns Unparsed instead of raising."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Message | Unparsed:
        try:
            return message_type.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever else bad bytes cause
            reason = str(exc)
            if name not in reason:
                reason = f"not a valid {name}: {reason}"
            return Unparsed(f"malformed request: {reason}")

    return parse


def checked(request: Any) -> Any:
    """The request as given; MalformedRequest if it is Unparsed. A client stream (an
    iterator of requests) comes back wrapped, raising when it reaches an Unparsed one."""
    if isinstance(request, Unparsed):
        raise MalformedRequest(request.reason)
    if isinstance(request, Message) or not hasattr(request, "__next__"):
        return request
    return _checked_stream(request)


def _checked_stream(requests: Iterator[Any]) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, Unparsed):
            raise MalformedRequest(request.reason)
        yield request
