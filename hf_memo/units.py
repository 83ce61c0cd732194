"""Parsing of human-written sizes ("80GiB", "1.5TB") and token counts ("128k", "1M")."""

from __future__ import annotations

import re

_BYTE_UNITS = {
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_COUNT_UNITS = {"": 1, "k": 1024, "m": 1024**2}
_NUMBER_WITH_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Byte count from an int (bytes) or a string with a unit such as ``"80GiB"``, ``"80GB"``, ``"512MiB"``,
    ``"1TiB"`` or ``"512B"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB) and bare
    letters (K, M, G, T) powers of 1024. A string without a unit (``"80"``: 80 bytes or 80 GiB?) is an
    error that shows how to write it, except ``"0"``. Raises ``ValueError`` for anything else.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a size such as '80GiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    match = _NUMBER_WITH_UNIT.match(str(text))
    if match is None:
        raise ValueError(f"expected a size such as '80GiB' or '80GB', got {text!r}")
    number, unit = match.group(1), match.group(2).lower()
    if not unit and float(number) != 0:
        raise ValueError(f"{number} has no unit: write {number}GiB (binary) or {number}GB (decimal)")
    if unit and unit not in _BYTE_UNITS:
        raise ValueError(f"expected a size such as '80GiB' or '80GB', got {text!r}")
    return int(float(number) * _BYTE_UNITS.get(unit, 1))


def parse_tokens(text: str | int) -> int:
    """Token count from an int or a string such as ``"4096"``, ``"128k"`` (131072) or ``"1M"`` (1048576).

    ``k`` and ``M`` are powers of 1024, as sequence lengths are usually quoted. Must be positive.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _NUMBER_WITH_UNIT.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _COUNT_UNITS:
            raise ValueError(f"expected a token count such as '4096', '128k' or '1M', got {text!r}")
        value = int(float(match.group(1)) * _COUNT_UNITS[unit])
    if value <= 0:
        raise ValueError(f"a token count must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``; binary units, two decimals."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_tokens(n: int) -> str:
    """``131072 -> '128K'``, ``1048576 -> '1M'``, ``5000 -> '5000'``."""
    if n >= 1024**2 and n % 1024**2 == 0:
        return f"{n // 1024**2}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)
