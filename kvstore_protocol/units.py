"""Parsing of human sizes ("512MiB", "4GiB") and durations ("2s", "500ms")."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_duration", "parse_size"]

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from "512MiB", "4GiB", "1.5G" or a plain integer; ValueError if malformed."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    match = _NUMBER_UNIT.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 4GiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str | float | int) -> float:
    """Seconds from "2s", "500ms", "1m" or a plain number of seconds."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"duration must not be negative, got {text}")
        return float(text)
    match = _NUMBER_UNIT.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {text!r} (examples: 30s, 500ms, 2m)")
    return float(match.group(1)) * _DURATION_UNITS[unit]


def format_size(n: int) -> str:
    """Bytes as a short human string, binary units."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
