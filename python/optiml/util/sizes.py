"""Byte sizes: read from the user ("6GiB", "512MiB", 1024) and shown in MiB."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

import numpy as np

from .._core import ArgumentError

__all__ = ["mib", "parse_size"]

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS[_p + "b"] = 1000**_i
    _UNITS[_p + "ib"] = 1024**_i
# The largest size taken: 1 EiB, far past any memory, and within what the native plan (int64) and a GGUF
# (UINT64) hold, so a mistyped size is refused here, not after the work that uses it.
MAX_SIZE = 2**60
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text) -> int:
    """Bytes in `text`: an integer, or a number with a unit: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB
    (powers of 1024), case-insensitive, optional space, decimals allowed ("1.5GiB"; rounded down to whole bytes).
    ArgumentError for negative, empty or unparseable sizes, and for sizes past MAX_SIZE (1 EiB)."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        if text < 0:
            raise ArgumentError(f"a size cannot be negative: {text}")
        return _at_most_max(int(text), text)
    if not isinstance(text, str):
        raise ArgumentError(f"a size must be a string or an integer, not {type(text).__name__}")
    if text.strip().startswith("-"):
        raise ArgumentError(f"a size cannot be negative: {text!r}")
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ArgumentError(f"cannot read {text!r} as a size: expected a number of bytes, optionally with a unit "
                            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 6GiB or 512MiB")
    try:
        value = Decimal(m.group(1)) * _UNITS[unit]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ArgumentError(f"cannot read {text!r} as a size") from None
    return _at_most_max(int(value), text)  # int(Decimal) truncates: whole bytes, rounded down


def _at_most_max(n: int, text) -> int:
    if n > MAX_SIZE:
        raise ArgumentError(f"a size cannot be more than 2**60 bytes (1,048,576 TiB): {text!r}")
    return n


def mib(n: int, spec: str = ",.1f") -> str:
    """n bytes in MiB with the unit, formatted by `spec` ("1,234.5 MiB"; "9.2f" pads to a column)."""
    return f"{n / 2**20:{spec}} MiB"
