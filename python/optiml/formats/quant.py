"""Block formats of GGUF tensors: quantize, dequantize, dot products (numpy in, numpy out).

Types are named as ggml names them: a string (``"q4_k"`` or ``"Q4_K"``), a ggml type id (int) or a
``gguf.GGMLQuantizationType``. Quantized data is ``np.uint8`` with the last axis holding a row's
bytes; quantize of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, F16 and BF16 gives the same bytes as
``gguf.quants.quantize``, k-quants (Q2_K..Q6_K) use llama.cpp's reference search and layouts, and IQ4_NL and
IQ4_XS give ggml's quantize_iq4_nl / _iq4_xs bytes (no importance matrix).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _core
from .._core import ArgumentError

__all__ = ["TypeInfo", "dequantize", "dot", "matmul", "quantize", "type_id", "type_info"]


class TypeInfo(NamedTuple):
    id: int
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block
    quantized: bool
    vec_dot_type: str  # what activations are converted to for a dot product with this type


def type_id(qtype) -> int:
    """The ggml type id of ``qtype`` (name, int or ``gguf.GGMLQuantizationType``)."""
    if isinstance(qtype, str):
        t = _core.type_from_name(qtype)
        if t < 0:
            raise ArgumentError(f"unknown tensor type {qtype!r}")
        return t
    if isinstance(qtype, (bool, np.bool_)) or not isinstance(qtype, (int, np.integer)):
        raise ArgumentError(f"a tensor type must be a ggml name or type id, not {type(qtype).__name__}")
    _core.type_traits(int(qtype))  # raises ArgumentError for unknown ids
    return int(qtype)  # IntEnum members (GGMLQuantizationType) are ints


def type_info(qtype) -> TypeInfo:
    """Name, block size and bytes per block of a tensor type."""
    t = type_id(qtype)
    name, bs, ts, q, vdt = _core.type_traits(t)
    return TypeInfo(t, name, bs, ts, q, _core.type_traits(vdt)[0])


def _floats(x, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "biuf":
        raise ArgumentError(f"{what} must hold real numbers, not dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _bytes(data, what: str) -> np.ndarray:
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = np.frombuffer(data, dtype=np.uint8)
    a = np.asarray(data)
    if a.dtype != np.uint8:
        raise ArgumentError(f"{what} must be np.uint8 bytes, not dtype {a.dtype}")
    return np.ascontiguousarray(a)


def quantize(x, qtype) -> np.ndarray:
    """Quantizes float values (any shape, last axis a multiple of the block size) to ``qtype``.

    Returns ``np.uint8`` of shape ``(*x.shape[:-1], row_bytes)``.
    """
    t = type_info(qtype)
    a = _floats(x, "x")
    if a.ndim == 0:
        raise ArgumentError("x must have at least one dimension")
    n = a.shape[-1]
    if n % t.block_size:
        raise ArgumentError(f"row length {n} is not a multiple of {t.block_size}, the block size of {t.name}")
    out = _core.quantize(a.reshape(-1, n), t.id)
    return out.reshape(*a.shape[:-1], out.shape[-1])


def dequantize(data, qtype, n: int | None = None) -> np.ndarray:
    """Values of ``qtype`` rows: ``data`` is np.uint8 with each row's bytes on the last axis.

    ``n`` (elements per row) defaults to what the row's bytes hold. Returns float32 ``(..., n)``.
    """
    t = type_info(qtype)
    a = _bytes(data, "data")
    if a.ndim == 0:
        raise ArgumentError("data must have at least one dimension")
    nbytes = a.shape[-1]
    if n is None:
        if nbytes % t.type_size:
            raise ArgumentError(f"a row of {nbytes} bytes is not a whole number of {t.name} blocks ({t.type_size} bytes)")
        n = nbytes // t.type_size * t.block_size
    out = _core.dequantize(a.reshape(-1, nbytes), t.id, int(n))
    return out.reshape(*a.shape[:-1], int(n))


def _simd(simd) -> str:
    return "" if simd is None else str(simd)


def dot(w_row, qtype, x, simd: str | None = None) -> float:
    """Dot product of one weight row (bytes of ``qtype``) with float activations ``x`` (1-D).

    Works as llama.cpp does: ``x`` is converted to the type's vec_dot_type (e.g. Q8_0 for Q4_0,
    Q8_K for the k-quants) first. ``simd`` picks a kernel level ("scalar", "avx2", ...); None = best.
    """
    t = type_id(qtype)
    w = _bytes(w_row, "w_row")
    xa = _floats(x, "x")
    if w.ndim != 1 or xa.ndim != 1:
        raise ArgumentError("dot takes one weight row and a 1-D activation vector")
    xq = _core.convert_activation(xa, t, _simd(simd))
    return _core.vec_dot_converted(t, w, xq, xa.shape[0], _simd(simd))


def matmul(w, qtype, x, n_threads: int = 0, simd: str | None = None, rows16: bool = False) -> np.ndarray:
    """``y[..., r] = dot(w[r], x[...])`` for weight rows ``w`` (2-D bytes) and activations ``x`` (1-D or 2-D).
    rows16: ``w`` is in the rows16 layout (:func:`rows16`; the kernels with a rows16 product only)."""
    t = type_id(qtype)
    wa = _bytes(w, "w")
    xa = _floats(x, "x")
    if wa.ndim != 2 or xa.ndim not in (1, 2):
        raise ArgumentError("matmul takes 2-D weight bytes and 1-D or 2-D activations")
    y = _core.matmul(wa, t, xa.reshape(-1, xa.shape[-1]), _simd(simd), int(n_threads), bool(rows16))
    return y[0] if xa.ndim == 1 else y


def rows16(w, qtype, cols: int, back: bool = False) -> np.ndarray:
    """A copy of row-layout matrix ``w`` (2-D bytes, ``cols`` elements a row) in the rows16 layout that
    CPU-only models read into memory keep their dense Q4_0/Q4_1/Q8_0 matrices in (16 rows' blocks
    together); with ``back``, a rows16 matrix returned to rows."""
    return _core.rows16(_bytes(w, "w"), type_id(qtype), int(cols), not back)
