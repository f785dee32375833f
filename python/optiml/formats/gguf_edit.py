"""Rewriting a GGUF file: the same file with some metadata set or removed and some tensors transformed.

    rewrite_gguf("in.gguf", "out.gguf",
                 set_kv={"optiml.placement.version": (1, GGUFValueType.UINT32)},
                 remove_prefixes=("optiml.placement.",),
                 transforms={"blk.0.ffn_gate.weight": lambda t, data: (data[order], t.type, t.shape)})

Every key/value pair of the source is copied as its exact bytes (so its type, arrays included, is kept),
in the source's order; keys in set_kv replace the source's value in place or are appended. Tensors keep
their order and the file's alignment; each tensor's bytes are copied (or transformed) one at a time from
the mapped source, so memory stays at about one tensor whatever the model's size. The output is written to
a temporary file in the output's folder and renamed over it only once complete: it appears whole or not at all.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from typing import Any, Callable

import numpy as np
from gguf import GGUFValueType

from . import gguf as _gguf
from . import quant
from .._core import ArgumentError, GGUFError
from ..util.atomic import atomic_output

__all__ = ["GGUFValueType", "encode_kv", "read_kv_spans", "rewrite_gguf"]

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_SIZE = {t: struct.calcsize(f) for t, f in _SCALAR.items()}
_NP = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}
_FROM_NP = {np.dtype(v): k for k, v in _NP.items()}

# A transform gets the source tensor's info and its bytes (read-only uint8 view, rows x row_bytes) and
# returns (bytes as a uint8 array, ggml type, shape in ggml order: innermost first, as TensorInfo.shape).
Transform = Callable[[_gguf.TensorInfo, np.ndarray], "tuple[np.ndarray, int, tuple]"]


# ---- key/value bytes ------------------------------------------------------------------------------
def _skip_value(buf, pos: int, vtype: int, depth: int = 0) -> int:
    """The position after one value of vtype starting at pos."""
    if vtype in _SIZE:
        return pos + _SIZE[vtype]
    if vtype == GGUFValueType.STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    if vtype == GGUFValueType.ARRAY:
        if depth > 8:
            raise GGUFError("GGUF arrays nested too deeply")
        sub, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if sub in _SIZE:
            return pos + count * _SIZE[sub]
        for _ in range(count):
            pos = _skip_value(buf, pos, sub, depth + 1)
        return pos
    raise GGUFError(f"unknown GGUF value type {vtype}")


def read_kv_spans(path: str | os.PathLike) -> tuple[int, list[tuple[str, int, bytes]]]:
    """(version, [(key, value type, the key/value pair's exact bytes: key, type and value)]) in file order.
    Call on a file optiml.gguf.open has validated (offsets are trusted here)."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
        pos = 24
        out = []
        for _ in range(n_kv):
            start = pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            key = bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8")
            pos += 8 + n
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos = _skip_value(buf, pos + 4, vtype)
            out.append((key, vtype, bytes(buf[start:pos])))
    return version, out


def _infer_type(value: Any) -> GGUFValueType:
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(value, (str, bytes)):
        return GGUFValueType.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return GGUFValueType.ARRAY
    if isinstance(value, np.generic):
        return _FROM_NP[value.dtype]
    if isinstance(value, int):
        return GGUFValueType.INT32 if -(2**31) <= value < 2**31 else GGUFValueType.INT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    raise ArgumentError(f"cannot store a {type(value).__name__} as GGUF metadata")


def _encode_value(value: Any, vtype: GGUFValueType) -> bytes:
    if vtype in _SCALAR:
        try:
            return struct.pack(_SCALAR[vtype], value.item() if isinstance(value, np.generic) else value)
        except struct.error as e:
            raise ArgumentError(f"{value!r} does not fit GGUF type {vtype.name}: {e}") from None
    if vtype == GGUFValueType.STRING:
        b = value if isinstance(value, bytes) else str(value).encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    if vtype == GGUFValueType.ARRAY:
        if isinstance(value, np.ndarray):
            if value.dtype not in _FROM_NP:
                raise ArgumentError(f"cannot store a numpy array of {value.dtype} as a GGUF array")
            a = np.ascontiguousarray(value.reshape(-1), dtype=value.dtype.newbyteorder("<"))
            return struct.pack("<IQ", _FROM_NP[value.dtype], a.size) + a.tobytes()
        items = list(value)
        sub = _infer_type(items[0]) if items else GGUFValueType.INT32
        if sub in (GGUFValueType.INT32, GGUFValueType.FLOAT32) and items:
            # a list of mixed ints/floats: widen to the first type that holds all of them
            if any(isinstance(v, float) for v in items):
                sub = GGUFValueType.FLOAT32
            elif any(not -(2**31) <= v < 2**31 for v in items):
                sub = GGUFValueType.INT64
        return struct.pack("<IQ", sub, len(items)) + b"".join(_encode_value(v, sub) for v in items)
    raise ArgumentError(f"unknown GGUF value type {vtype!r}")


def encode_kv(key: str, value: Any, vtype: GGUFValueType | None = None) -> bytes:
    """The bytes of one key/value pair. vtype None: inferred (int -> INT32/INT64, float -> FLOAT32,
    str -> STRING, list or numpy array -> ARRAY, its element type from the dtype or the first item)."""
    vtype = _infer_type(value) if vtype is None else GGUFValueType(vtype)
    k = key.encode("utf-8")
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + _encode_value(value, vtype)


# ---- the rewrite ----------------------------------------------------------------------------------
def _same_file(a: str, b: str) -> bool:
    if os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def check_output(src: str, dst: str) -> None:
    """ArgumentError when dst is src or its folder does not exist (before any work is done)."""
    if _same_file(src, dst):
        raise ArgumentError(f"the output {dst} is the input file; write to another file")
    folder = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(folder):
        raise ArgumentError(f"{dst}: the output folder {folder} does not exist")


def _tensor_nbytes(ggml_type: int, shape) -> int:
    info = quant.type_info(int(ggml_type))
    n0 = int(shape[0])
    if n0 % info.block_size:
        raise ArgumentError(f"a row of {n0} elements is not a whole number of {info.name} blocks ({info.block_size})")
    rows = int(np.prod([int(s) for s in shape[1:]], dtype=np.int64)) if len(shape) > 1 else 1
    return rows * (n0 // info.block_size) * info.type_size


def _tensor_info_bytes(name: str, shape, ggml_type: int, offset: int) -> bytes:
    n = name.encode("utf-8")
    return (struct.pack("<Q", len(n)) + n + struct.pack("<I", len(shape))
            + struct.pack(f"<{len(shape)}Q", *[int(s) for s in shape]) + struct.pack("<IQ", int(ggml_type), offset))


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def rewrite_gguf(src: str | os.PathLike, dst: str | os.PathLike,
                 set_kv: dict[str, tuple[Any, GGUFValueType | None]] | None = None,
                 remove_prefixes: tuple[str, ...] | list[str] = (),
                 transforms: dict[str, Transform] | None = None,
                 progress: bool = True, desc: str = "writing") -> None:
    """Writes dst: src with keys starting with any of remove_prefixes dropped, then set_kv's keys set
    (value, GGUF type or None to infer), and the tensors named in transforms replaced by what their
    transform returns (it may change the type and shape, not the number of dimensions). Everything else
    is copied byte for byte. ArgumentError when dst is src or dst's folder is missing; on any error
    nothing is left at dst (an existing dst is untouched)."""
    src, dst = os.fspath(src), os.fspath(dst)
    set_kv = dict(set_kv or {})
    transforms = dict(transforms or {})
    if not os.path.isfile(src):
        raise FileNotFoundError(f"model file not found: {src}")
    check_output(src, dst)

    f = _gguf.open(src)  # validates every offset and size
    names = {t.name for t in f.tensors}
    unknown = sorted(set(transforms) - names)
    if unknown:
        raise ArgumentError(f"{src}: no tensor named {', '.join(map(repr, unknown))}")
    version, kvs = read_kv_spans(src)
    if len(kvs) != len(f.metadata):
        raise GGUFError(f"{src}: read {len(kvs)} key/value pairs, the header says {len(f.metadata)}")

    # key/values: the source's in order (minus removed), replaced in place or appended
    out_kv: dict[str, bytes] = {}
    prefixes = tuple(remove_prefixes)
    for key, _vtype, raw in kvs:
        if prefixes and key.startswith(prefixes):
            continue
        out_kv[key] = raw
    for key, (value, vtype) in set_kv.items():
        out_kv[key] = encode_kv(key, value, vtype)
    align = f.alignment
    if "general.alignment" in set_kv:
        align = int(set_kv["general.alignment"][0])
    if align <= 0 or align % 8:
        raise ArgumentError(f"general.alignment must be a positive multiple of 8, not {align}")

    bar = None
    try:
        with atomic_output(dst) as tmp, open(tmp, "wb") as out:
            out.write(struct.pack("<IIQQ", 0x46554747, version, len(f.tensors), len(out_kv)))
            for raw in out_kv.values():
                out.write(raw)
            # tensor infos as in the source for now; rewritten below once types, shapes, offsets are final
            ti_pos = out.tell()
            for t in f.tensors:
                out.write(_tensor_info_bytes(t.name, t.shape, t.type, 0))
            data_start = _pad(out.tell(), align)
            out.write(b"\0" * (data_start - out.tell()))

            if progress:
                from tqdm import tqdm

                bar = tqdm(total=sum(t.n_bytes for t in f.tensors), unit="B", unit_scale=True, desc=desc,
                           file=sys.stderr, leave=False, dynamic_ncols=True)
            final = []
            rel = 0
            for t in f.tensors:
                data = f.tensor_data(t.name)
                ttype, shape = t.type, tuple(t.shape)
                if t.name in transforms:
                    data, ttype, shape = transforms[t.name](t, data)
                    data = np.ascontiguousarray(data)
                    shape = tuple(int(s) for s in shape)
                    if data.dtype != np.uint8:
                        raise ArgumentError(f"the transform of {t.name} returned {data.dtype}, not uint8 bytes")
                    if len(shape) != len(t.shape):
                        raise ArgumentError(f"the transform of {t.name} changed its number of dimensions "
                                            f"({len(t.shape)} -> {len(shape)})")
                    want = _tensor_nbytes(ttype, shape)
                    if data.nbytes != want:
                        raise ArgumentError(f"the transform of {t.name} returned {data.nbytes} bytes, "
                                            f"its type and shape {list(shape)} take {want}")
                final.append((t.name, shape, ttype, rel))
                out.write(np.ascontiguousarray(data).reshape(-1).data)
                n = data.nbytes
                padded = _pad(n, align)
                out.write(b"\0" * (padded - n))
                rel += padded
                del data
                if bar is not None:
                    bar.update(t.n_bytes)
            out.seek(ti_pos)
            for name, shape, ttype, off in final:
                out.write(_tensor_info_bytes(name, shape, ttype, off))
            out.flush()
            os.fsync(out.fileno())
    finally:
        if bar is not None:
            bar.close()
        f.close()
