"""How a Model opens its file: the model argument as a file, and the weights mapped or read whole into
private memory (use_mmap)."""

from __future__ import annotations

import os
from typing import Callable

from .. import _core
from .._core import ArgumentError, OptimlError
from ..hub.registry import resolve
from ..util import memory

__all__ = ["auto_in_memory", "model_file", "open_weights"]


def model_file(path: str | os.PathLike) -> str:
    """The GGUF file a model argument names: a path, or a known model name or Hugging Face reference
    (pulled into its cache on first use). FileNotFoundError or IsADirectoryError when it is not a file."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"the model must be a path or a model name, not {type(path).__name__}")
    path = resolve(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file not found: {path} (give a GGUF file's path, a known model name "
                                "(optiml pull --list) or a Hugging Face reference org/repo[:QUANT])")
    if os.path.isdir(path):
        raise IsADirectoryError(f"expected a GGUF file, got a directory: {path}")
    return path


def open_weights(path: str, use_mmap) -> _core.Model:
    """The file opened for use_mmap: False reads it into memory; True maps it; "auto" maps it too, and
    reads only its metadata until the plan says where layers run (see auto_in_memory)."""
    if not isinstance(use_mmap, bool) and use_mmap != "auto":
        raise ArgumentError(f"use_mmap must be True, False or 'auto', not {use_mmap!r}")
    return _core.Model(os.fsencode(path), in_memory=use_mmap is False)


def auto_in_memory(path: str, plan: Callable[[], dict]) -> bool:
    """use_mmap="auto": read the file into memory when the OS has transparent huge pages, the file takes
    at most half of the memory available, and the plan (a callable returning the plan dict, called last)
    runs every layer on the CPU: a device's weights need no private host copy."""
    if not memory.huge_pages_allowed():
        return False
    available = memory.memory_available()
    if available is None or os.path.getsize(path) > available // 2:
        return False
    try:
        return plan()["device"] == "cpu"
    except OptimlError:
        return False  # the session reports the bad plan itself
