"""JSON that every parser reads: NaN and +/-Infinity (which json.dumps writes by default, and strict parsers
refuse) become null, numpy values plain numbers and lists, bytes text.

    from optiml.util.jsonout import dump, dumps, finite
    dumps({"coverage": float("nan")})        # '{"coverage": null}'
    finite({"x": np.float32("inf")})         # {'x': None}: for writers that take Python values
"""

from __future__ import annotations

import json
import math

import numpy as np

__all__ = ["dump", "dumps", "finite"]


def finite(obj):
    """obj with every float that is not finite replaced by None, numpy scalars and arrays as Python values,
    tuples as lists and bytes decoded (invalid UTF-8 replaced); dict keys are kept. Other objects are left
    as they are (json.dumps then refuses what it cannot write)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int)) or obj is None:  # (bool is an int)
        return obj
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return finite(obj.tolist())
    if isinstance(obj, np.generic):
        return finite(obj.item())
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).decode("utf-8", errors="replace")
    return obj


def dumps(obj, **kwargs) -> str:
    """json.dumps of finite(obj), with allow_nan=False as the guard: no NaN or Infinity gets written."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def dump(obj, f, **kwargs) -> None:
    """json.dump of finite(obj) into the open text file f, with allow_nan=False."""
    json.dump(finite(obj), f, allow_nan=False, **kwargs)
