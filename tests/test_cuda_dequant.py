"""The CUDA kernels' block decoders (native/src/cuda/dequant.cuh), run on the host through
_core._cuda_dequant_host, against gguf-py (an independent implementation) and the CPU library.

Equality is bitwise everywhere: in every format each scale * code product is exact in float32 (an
11-bit fp16 mantissa times codes and sub-scales of at most 13 bits together), so the only rounding
is a final "+ m" / "- m" and any evaluation order, gguf-py's numpy broadcasting included, gives the
same bits.
"""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from optiml import _core
from optiml import quant
from optiml._core import ArgumentError

# gguf-py's float16 cast warns on the out-of-range test values; overflowing to inf is the point.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
QUANTIZED = TYPES[3:]
GGUF_QUANTIZES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
OPTIML_QUANTIZES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4"}
# The CPU library has no IQ4_NL/IQ4_XS decoder: only gguf-py checks those.
CPU_DEQUANTIZES = set(TYPES) - {"IQ4_NL", "IQ4_XS"}

# Byte offsets of each block's fp16 scale fields (d, m / dmin): ggml_types.h, and ggml-common.h for IQ4.
SCALE_OFFSETS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0],
    "MXFP4": [],  # (its scale is an E8M0 byte: every value is one)
}


def sizes(name):
    """(elements, bytes) of a block as the CUDA decoders see it: 8-element blocks for plain floats."""
    bs, ts = gguf.GGML_QUANT_SIZES[GT[name]]
    return (8, 8 * ts) if bs == 1 else (bs, ts)


def cuda_host(name, data: np.ndarray) -> np.ndarray:
    bs, ts = sizes(name)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1).tobytes()
    assert len(raw) % ts == 0
    return _core._cuda_dequant_host(int(GT[name]), raw, len(raw) // ts * bs)


def assert_same_floats(a, b):
    """Bitwise equality, except that any NaN equals any NaN."""
    a = np.asarray(a, np.float32).reshape(-1)
    b = np.asarray(b, np.float32).reshape(-1)
    assert a.shape == b.shape
    na, nb = np.isnan(a), np.isnan(b)
    assert np.array_equal(na, nb), "NaN positions differ"
    bad = (a.view(np.uint32) != b.view(np.uint32)) & ~na
    assert not bad.any(), f"{bad.sum()} values differ, first at {np.argwhere(bad)[0]}: {a[bad][0]!r} vs {b[bad][0]!r}"


def random_blocks(rng, name, n_blocks) -> np.ndarray:
    """Random bytes with every fp16 scale field a finite value, tiny (subnormal) ones included."""
    _, ts = sizes(name)
    blocks = rng.integers(0, 256, (n_blocks, ts), dtype=np.uint8)
    for off in SCALE_OFFSETS[name]:
        mag = 2.0 ** rng.uniform(-26, 4, n_blocks)  # below 2^-24 rounds to 0: zero scales too
        d = (rng.choice([-1.0, 1.0], n_blocks) * mag).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def quantized_blocks(rng, name, n_blocks) -> np.ndarray:
    """Blocks a quantizer wrote from random floats of varied magnitude."""
    bs, _ = sizes(name)
    x = (rng.standard_normal((n_blocks, bs)) * 10.0 ** rng.uniform(-4, 3, (n_blocks, 1))).astype(np.float32)
    if name in GGUF_QUANTIZES:
        return gguf.quants.quantize(x, GT[name])
    return quant.quantize(x, name)


def float_blocks(rng, name, n) -> np.ndarray:
    """n values of a plain float type: random numbers through gguf-py, then zeros, infinities, NaN."""
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)).astype(np.float32)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40]
    if name == "F32":
        return x
    return np.ascontiguousarray(gguf.quants.quantize(x, GT[name])).view(np.uint8)


def check(name, data: np.ndarray):
    got = cuda_host(name, data)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    assert_same_floats(got, gguf.quants.dequantize(raw, GT[name]))
    if name in CPU_DEQUANTIZES:
        assert_same_floats(got, quant.dequantize(raw, name))


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types(rng, name):
    check(name, float_blocks(rng, name, 8 * 64))


@pytest.mark.parametrize("name", QUANTIZED)
def test_random_blocks(rng, name):
    check(name, random_blocks(rng, name, 64))


@pytest.mark.parametrize("name", sorted(GGUF_QUANTIZES | OPTIML_QUANTIZES))
def test_quantized_blocks(rng, name):
    check(name, quantized_blocks(rng, name, 64))


def test_iq4_every_code(rng):
    # Each nibble value in each position, so every kvalues_iq4nl entry and sub-block scale is read.
    for name in ["IQ4_NL", "IQ4_XS"]:
        blocks = random_blocks(rng, name, 16)
        start = 2 if name == "IQ4_NL" else 8
        for v in range(16):
            blocks[v, start:] = v | (15 - v) << 4
        check(name, blocks)


def test_mxfp4_every_scale_and_code(rng):
    # Every E8M0 byte (the denormal halves of e = 0 and 1, and 255) with every code in each half of a block.
    blocks = random_blocks(rng, "MXFP4", 256)
    blocks[:, 0] = np.arange(256)
    for v in range(16):
        blocks[v::16, 1:] = v | (15 - v) << 4
    check("MXFP4", blocks)


def test_every_half_and_bfloat16():
    bits = np.arange(65536, dtype=np.uint16)
    # F16: numpy's float16 -> float32 conversion; the library's fp16_to_fp32 also through check().
    assert_same_floats(cuda_host("F16", bits), bits.view(np.float16).astype(np.float32))
    check("F16", bits)
    # NaN payloads too: dequant.cuh sets the quiet bit, as fp16_to_fp32's float multiply does on x86 and ARM.
    assert np.array_equal(cuda_host("F16", bits).view(np.uint32), quant.dequantize(bits.view(np.uint8), "F16").view(np.uint32))
    # BF16: the high half of a float32.
    assert_same_floats(cuda_host("BF16", bits), (bits.astype(np.uint32) << 16).view(np.float32))
    check("BF16", bits)


def test_block_sizes_match_type_table():
    for name in QUANTIZED:
        info = quant.type_info(name) if name in CPU_DEQUANTIZES else None
        bs, ts = sizes(name)
        if info:
            assert (info.block_size, info.type_size) == (bs, ts)
        # One whole block decodes; one byte less or more does not.
        _core._cuda_dequant_host(int(GT[name]), bytes(ts), bs)
        for wrong in (ts - 1, ts + 1):
            with pytest.raises(ArgumentError, match="bytes"):
                _core._cuda_dequant_host(int(GT[name]), bytes(wrong), bs)


def test_errors():
    with pytest.raises(ArgumentError, match="does not support Q8_K"):
        _core._cuda_dequant_host(int(GT.Q8_K), bytes(292), 256)
    with pytest.raises(ArgumentError, match="does not support IQ2_XXS"):
        _core._cuda_dequant_host(int(GT.IQ2_XXS), bytes(66), 256)
    with pytest.raises(ArgumentError, match="unknown tensor type id 1000"):
        _core._cuda_dequant_host(1000, b"", 0)
    with pytest.raises(ArgumentError, match="not a whole number of blocks"):
        _core._cuda_dequant_host(int(GT.Q4_0), bytes(18), 16)
    with pytest.raises(ArgumentError, match="not a whole number of blocks"):
        _core._cuda_dequant_host(int(GT.F32), bytes(20), 5)
    with pytest.raises(ArgumentError, match="not a whole number of blocks"):
        _core._cuda_dequant_host(int(GT.Q4_K), bytes(144), -256)
    with pytest.raises(ArgumentError, match="data holds 36 bytes, but 32 elements of Q4_0 take 18"):
        _core._cuda_dequant_host(int(GT.Q4_0), bytes(36), 32)
    with pytest.raises(ValueError):  # ArgumentError is a ValueError too
        _core._cuda_dequant_host(int(GT.F16), bytes(15), 8)
    assert _core._cuda_dequant_host(int(GT.Q6_K), b"", 0).shape == (0,)
