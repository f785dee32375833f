"""Checks of the arguments the engine's API takes: bad values are refused with ArgumentError (a ValueError)
before any work, naming the argument."""

from __future__ import annotations

import numpy as np

from .._core import ArgumentError

__all__ = ["boolean", "non_negative_int", "positive_int", "token_array", "token_id"]


# The native side counts tokens, positions and sequences in 32-bit integers.
INT_MAX = 2**31 - 1


def positive_int(name: str, v, most: int = INT_MAX) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ArgumentError(f"{name} must be a positive integer, got {v!r}")
    if v > most:
        raise ArgumentError(f"{name} must be at most {most}, got {v}")
    return int(v)


def non_negative_int(name: str, v, most: int = INT_MAX) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ArgumentError(f"{name} must be a non-negative integer, got {v!r}")
    if v > most:
        raise ArgumentError(f"{name} must be at most {most}, got {v}")
    return int(v)


def boolean(name: str, v) -> bool:
    """A flag: True or False (numpy's bools too). A string such as "no" is truthy, so it is refused rather than
    read as True."""
    if not isinstance(v, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be True or False, got {v!r}")
    return bool(v)


def token_id(v) -> int:
    """One token id as a Python int: an integer (numpy's too), not a float or a bool, which int() would
    silently turn into some other token. Its range is the caller's to check."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ArgumentError(f"token ids must be integers, got {v!r}")
    return int(v)


def token_array(tokens, n_vocab: int) -> np.ndarray:
    """Token ids as the native session takes them: a non-empty 1-D int32 array of ids in [0, n_vocab)."""
    a = np.asarray(tokens)
    if a.ndim != 1 or a.size == 0:
        raise ArgumentError("tokens must be a non-empty 1-D sequence of token ids")
    if a.dtype.kind not in "iu":
        raise ArgumentError(f"token ids must be integers, not {a.dtype}")
    if a.min() < 0 or a.max() >= n_vocab:
        raise ArgumentError(f"token ids must be in [0, {n_vocab}), got {int(a.min())}..{int(a.max())}")
    return np.ascontiguousarray(a, dtype=np.int32)
