"""A small validating safetensors reader: single files and sharded checkpoints (index.json).

Format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}
(plus an optional "__metadata__"), then the data. Every offset and size is checked against the file
before anything is read; data is memory-mapped, so reading a tensor touches only its own pages.
We read it ourselves because the safetensors numpy API cannot return bf16.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass

import numpy as np

from .errors import ConvertError

# safetensors dtype -> (numpy dtype of the stored bits, bytes per element). BF16 is kept as uint16
# and widened to float32 on read; U8 (gpt-oss's MXFP4 blocks and scales) is read as bytes.
_DTYPES = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "U8": (np.dtype("u1"), 1),
}
_MAX_HEADER = 100 << 20  # the reference implementation's limit
_CHUNK = 8 << 20  # bytes copied out of the map at a time


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # "F32" | "F16" | "BF16" | "U8"
    shape: tuple
    begin: int  # absolute offsets in the file
    end: int
    file: "SafetensorsFile"

    def load(self) -> np.ndarray:
        """The tensor as float32, U8 as uint8 (a fresh array; the map is only read)."""
        return self.file.read(self)


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = str(path)
        try:
            self._f = open(self.path, "rb")
        except OSError as e:
            raise ConvertError(f"{self.path}: cannot open: {e.strerror or e}") from None
        try:
            self.tensors = self._parse_header()
            size = os.fstat(self._f.fileno()).st_size
            self._map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except BaseException:
            self._f.close()
            raise

    def _fail(self, what: str):
        raise ConvertError(f"{self.path}: {what}")

    def _parse_header(self) -> dict:
        size = os.fstat(self._f.fileno()).st_size
        if size < 8:
            self._fail(f"file of {size} bytes is too short for a safetensors header")
        n = int.from_bytes(self._f.read(8), "little")
        if n > _MAX_HEADER or 8 + n > size:
            self._fail(f"header length {n} does not fit the file of {size} bytes (truncated or not safetensors)")
        try:
            header = json.loads(self._f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._fail(f"malformed JSON header: {e}")
        except RecursionError:  # (json recurses once per level)
            self._fail("malformed JSON header: nested too deeply (a corrupt file? download it again)")
        if not isinstance(header, dict):
            self._fail("malformed header: not a JSON object")
        base = 8 + n
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
                self._fail(f"tensor {name!r}: malformed header entry {info!r}")
            dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
            if dtype not in _DTYPES:
                self._fail(f"tensor {name!r} has dtype {dtype}; supported: {', '.join(_DTYPES)}")
            if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                    or not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)):
                self._fail(f"tensor {name!r}: malformed shape {shape!r} or data_offsets {offs!r}")
            begin, end = base + offs[0], base + offs[1]
            want = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype][1]
            if offs[0] < 0 or end - begin != want:
                self._fail(f"tensor {name!r}: data_offsets {offs} hold {end - begin} bytes, shape {shape} "
                           f"of {dtype} needs {want}")
            if end > size:
                self._fail(f"tensor {name!r} ends at byte {end}, past the end of the file ({size} bytes): truncated")
            out[name] = TensorEntry(name, dtype, tuple(shape), begin, end, self)
        return out

    def read(self, e: TensorEntry) -> np.ndarray:
        np_dtype = _DTYPES[e.dtype][0]
        out = np.empty(e.shape, np.uint8 if e.dtype == "U8" else np.float32)
        if e.end == e.begin:
            return out
        flat = out.reshape(-1)
        # Copy in chunks, dropping each chunk's mapped pages once copied: peak memory stays near the
        # tensor's float32 size instead of that plus its mapped source.
        step = max(1, _CHUNK // np_dtype.itemsize)
        for i in range(0, flat.size, step):
            n = min(step, flat.size - i)
            begin = e.begin + i * np_dtype.itemsize
            raw = np.frombuffer(self._map, dtype=np_dtype, count=n, offset=begin)
            if e.dtype == "BF16":  # bf16 is the top half of an f32
                flat[i:i + n].view(np.uint32)[:] = raw.astype(np.uint32) << 16
            else:
                flat[i:i + n] = raw
            del raw
            self._release(begin, begin + n * np_dtype.itemsize)
        return out

    def _release(self, begin: int, end: int) -> None:
        """Drops the mapped pages just read from this process's resident set (the page cache keeps
        them), so converting a model does not grow RSS to the model's size."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = begin - begin % mmap.PAGESIZE
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass  # only an optimisation

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            self._map.close()
            self._map = None
        self._f.close()


class Checkpoint:
    """All tensors of a checkpoint folder: model.safetensors, or the shards model.safetensors.index.json
    names. `entries[name]` is a TensorEntry; use as a context manager to close the files."""

    def __init__(self, folder: str):
        self.folder = str(folder)
        self.files: list[SafetensorsFile] = []
        self.entries: dict[str, TensorEntry] = {}
        try:
            for path in self._shard_paths():
                f = SafetensorsFile(path)
                self.files.append(f)
                for name, e in f.tensors.items():
                    if name in self.entries:
                        raise ConvertError(f"{path}: tensor {name!r} is also in {self.entries[name].file.path}")
                    self.entries[name] = e
        except BaseException:
            self.close()
            raise
        # A base model saved without its head (Qwen3-Embedding; sentence-transformers' transformer module): the
        # causal LM's tensors without their "model." prefix.
        if "embed_tokens.weight" in self.entries and not any(n.startswith("model.") for n in self.entries):
            self.entries = {"model." + n: e for n, e in self.entries.items()}

    def _shard_paths(self) -> list[str]:
        index = os.path.join(self.folder, "model.safetensors.index.json")
        single = os.path.join(self.folder, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConvertError(f"{index}: cannot read the shard index: {e}") from None
            except RecursionError:  # (json recurses once per level)
                raise ConvertError(f"{index}: cannot read the shard index: JSON nested too deeply (a corrupt "
                                   "file? download it again)") from None
            paths = [os.path.join(self.folder, s) for s in shards]
            missing = [p for p in paths if not os.path.isfile(p)]
            if missing:
                raise ConvertError(f"{index}: shard {missing[0]} is missing")
            return paths
        if os.path.isfile(single):
            return [single]
        others = sorted(p for p in os.listdir(self.folder) if p.endswith(".safetensors"))
        if len(others) == 1:
            return [os.path.join(self.folder, others[0])]
        raise ConvertError(f"{self.folder}: no model.safetensors or model.safetensors.index.json "
                           "(only safetensors checkpoints are supported)")

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
