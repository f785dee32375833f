"""Reading GGUF model files (versions 2 and 3).

    with optiml.gguf.open("model.gguf") as f:
        f.metadata["llama.block_count"]        # ints, floats, bools, str; numeric arrays as numpy
        f.tensors[0]                           # TensorInfo(name, type, type_name, shape, ...)
        f.tensor_data("token_embd.weight")     # zero-copy uint8 view (rows, row_bytes) of the mapping

Parsing is native (optiml._core): every count, size and offset is checked against the file, and a
malformed file raises optiml.GGUFError naming the problem.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from .. import _core
from .._core import GGUFError
from . import quant

__all__ = ["GGUFFile", "MissingTensorError", "TensorInfo", "open"]


class TensorInfo(NamedTuple):
    name: str
    type: int  # ggml type id
    type_name: str  # e.g. "Q4_1"
    shape: tuple  # ggml order, innermost first (as gguf-py's ReaderTensor.shape)
    n_elements: int
    n_bytes: int
    offset: int  # absolute offset of the data in the file


class MissingTensorError(GGUFError, KeyError):
    """No tensor of that name in the file."""

    __str__ = Exception.__str__  # KeyError would repr() the message


class GGUFFile:
    """An open GGUF file: metadata and tensor infos are read at open, tensor data is mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._f = _core.gguf_open(os.fsencode(self.path))
        self.version: int = self._f.version
        self.alignment: int = self._f.alignment
        self.data_offset: int = self._f.data_offset
        self.file_size: int = self._f.file_size
        self.metadata: dict[str, Any] = self._f.metadata()
        # GGUF value type of each key: "uint32", "string", "array[float32]", "array[array]", ...
        self.metadata_types: dict[str, str] = self._f.metadata_types()
        self.tensors: list[TensorInfo] = [TensorInfo(*t) for t in self._f.tensors()]
        self._by_name = {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise MissingTensorError(f"{self.path}: no tensor named {name!r}") from None

    def tensor_data(self, name: str) -> np.ndarray:
        """Read-only uint8 view (rows, row_bytes) of the tensor's bytes, rows = prod(shape[1:]).

        The view keeps the mapping alive on its own, also after close().
        """
        self.tensor(name)
        if self._f is None:
            raise ValueError(f"{self.path}: GGUF file is closed")
        return self._f.tensor_data(name)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor's values as float32, in numpy order (the ggml shape reversed)."""
        t = self.tensor(name)
        data = self.tensor_data(name)
        return quant.dequantize(data, t.type, t.shape[0]).reshape(tuple(reversed(t.shape)))

    def close(self) -> None:
        """Drops the native file; views from tensor_data() stay valid."""
        self._f = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        types = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        arch = self.metadata.get("general.architecture", "?")
        name = self.metadata.get("general.name", "?")
        return (
            f"GGUF v{self.version} {self.path}: {name!s} ({arch!s}), {len(self.metadata)} metadata keys, "
            f"{len(self.tensors)} tensors ({types}), data at {self.data_offset}, "
            f"alignment {self.alignment}, {self.file_size} bytes"
        )

    def __repr__(self) -> str:
        state = "closed" if self._f is None else "open"
        return f"<optiml.gguf.GGUFFile {self.path!r} v{self.version}, {len(self.tensors)} tensors, {state}>"


def open(path: str | os.PathLike) -> GGUFFile:  # noqa: A001 - mirrors builtins.open on purpose
    """Opens a GGUF file. Raises FileNotFoundError (or another OSError) when it cannot be opened
    and optiml.GGUFError when it is not a valid GGUF file."""
    return GGUFFile(path)
