"""Multithreaded matrix-vector and matrix-matrix products (native/src/cpu/matmul.cpp)."""

import numpy as np
import pytest

import optiml
from optiml import quant

TYPES = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "q2_k", "q3_k", "q4_k", "q5_k",
         "q6_k"]


def _weights(rows, cols, qtype, seed=0):
    rng = np.random.default_rng(seed)
    wf = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    return quant.quantize(wf, qtype)


def test_f32_matvec_matches_float64():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 512)).astype(np.float32)
    x = rng.standard_normal(512).astype(np.float32)
    y = quant.matmul(quant.quantize(w, "f32"), "f32", x)
    ref = w.astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(w).sum(axis=1).max())


@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_equals_rowwise_dot_and_is_thread_count_independent(qtype):
    cols = 1024
    w = _weights(77, cols, qtype, seed=2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    y1 = quant.matmul(w, qtype, x, n_threads=1)
    assert y1.shape == (5, 77) and y1.dtype == np.float32
    # Every row is computed by one thread in one order, so thread count cannot change any bit.
    for n in (2, 3, 7):
        np.testing.assert_array_equal(quant.matmul(w, qtype, x, n_threads=n), y1)
    # A batch computes exactly what token-by-token matrix-vector products compute.
    for t in range(5):
        np.testing.assert_array_equal(quant.matmul(w, qtype, x[t], n_threads=2), y1[t])
    # ... and what one dot product per row computes.
    for r in (0, 40, 76):
        assert quant.dot(w[r], qtype, x[2]) == y1[2, r]


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k", "q8_0", "mxfp4", "f16"])
def test_matmul_close_to_float64_reference(qtype):
    rows, cols = 64, 2048
    w = _weights(rows, cols, qtype, seed=4)
    wd = quant.dequantize(w, qtype).astype(np.float64)
    x = np.random.default_rng(5).standard_normal((3, cols)).astype(np.float32)
    y = quant.matmul(w, qtype, x)
    ref = x.astype(np.float64) @ wd.T
    # Activations are converted to 8 bits (Q8_0/Q8_K) or f16: relative error of a few 1e-3 at most.
    scale = np.abs(wd).sum(axis=1) * np.abs(x).max()
    assert np.all(np.abs(y - ref) <= 1e-2 * scale)


def test_bad_arguments_are_clear_errors():
    w = _weights(8, 64, "q4_0")
    with pytest.raises(optiml.ArgumentError, match="bytes per row"):
        quant.matmul(w[:, :-1].copy(), "q4_0", np.zeros(64, np.float32))
    with pytest.raises(optiml.ArgumentError):
        quant.matmul(w, "q4_0", np.zeros(48, np.float32))
    with pytest.raises(optiml.ArgumentError):
        quant.matmul(w, "no_such_type", np.zeros(64, np.float32))
    with pytest.raises(optiml.ArgumentError):
        quant.matmul(w, "q4_0", np.zeros(64, np.float32), n_threads=-1)


BLOCK32 = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4"]


@pytest.mark.parametrize("simd", [lv for lv in optiml._core.simd_levels()])
@pytest.mark.parametrize("qtype", BLOCK32)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 15, 17, 31, 77, 129])
def test_matvec_multirow_kernel_equals_rowwise_dot(qtype, rows, simd):
    # One token goes through the multi-row matrix-vector kernel (several rows share each activation
    # block); every row must still equal that row's own dot product bit for bit, odd row counts and
    # the kernels' row remainders included.
    for cols in (32, 96, 4096):
        w = _weights(rows, cols, qtype, seed=rows * 7 + cols)
        rng = np.random.default_rng(rows + cols)
        x = rng.standard_normal(cols).astype(np.float32)
        for n_threads in (1, 2):
            y = quant.matmul(w, qtype, x, n_threads=n_threads, simd=simd)
            ref = np.array([quant.dot(w[r], qtype, x, simd=simd) for r in range(rows)], np.float32)
            np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("simd", [lv for lv in optiml._core.simd_levels()])
@pytest.mark.parametrize("qtype", TYPES)
def test_batched_product_equals_rowwise_dot(qtype, simd):
    # Batches go through the tiled batch kernel (several rows and tokens per tile, rows unpacked once
    # for all tokens); every (row, token) must still equal that row's own dot product bit for bit:
    # full tiles, the row and token edges of the tile sizes, and the 64-token blocks of matmul.cpp.
    # The kernels with rows in the lanes take over from 32 tokens (the 32-element formats with AVX-512VNNI;
    # the k-quants with 8 rows in a ymm, every other x86 level) and from 8 (the k-quants with 16 rows in a
    # zmm, AVX-512VNNI): (21, 8), (19, 17), (16, 32), (37, 45) and (6, 67) cover their full and partial row
    # panels and token tiles.
    cols = 512
    rng = np.random.default_rng(11)
    for rows, n_tokens in ((1, 2), (5, 3), (17, 4), (8, 2), (9, 7), (21, 8), (19, 17), (16, 32), (37, 45), (6, 67)):
        w = _weights(rows, cols, qtype, seed=rows * 31 + n_tokens)
        x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
        y = quant.matmul(w, qtype, x, n_threads=2, simd=simd)
        ref = np.array([[quant.dot(w[r], qtype, x[t], simd=simd) for r in range(rows)] for t in range(n_tokens)],
                       np.float32)
        np.testing.assert_array_equal(y, ref, err_msg=f"{rows} rows x {n_tokens} tokens")


KQUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


@pytest.mark.parametrize("simd", [lv for lv in optiml._core.simd_levels()])
@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_matvec_kernel_equals_rowwise_dot(qtype, simd):
    # The k-quant matrix-vector kernel takes rows four at a time (the remainder one by one), short and
    # long: both paths, at every row count and length, give each row its vec_dot's bits.
    for rows in (1, 3, 4, 5, 9, 31):
        for cols in (256, 768, 1024, 4096):
            w = _weights(rows, cols, qtype, seed=rows + cols)
            x = np.random.default_rng(rows).standard_normal(cols).astype(np.float32)
            y = quant.matmul(w, qtype, x, n_threads=2, simd=simd)
            ref = np.array([quant.dot(w[r], qtype, x, simd=simd) for r in range(rows)], np.float32)
            np.testing.assert_array_equal(y, ref)


ROWS16_TYPES = ["q4_0", "q4_1", "q8_0"]
ROWS16_LEVELS = [lv for lv in optiml._core.simd_levels() if optiml._core.has_rows16(lv)]


@pytest.mark.skipif(not ROWS16_LEVELS, reason="no SIMD level here has the rows16 product (AVX-512VNNI)")
@pytest.mark.parametrize("qtype", ROWS16_TYPES)
def test_rows16_product_equals_rowwise_dot(qtype):
    # The rows16 layout (16 rows' blocks together, read by the row-lane kernel without a per-call
    # transpose): every (row, token) equals that row's own dot product bit for bit. Token counts cover
    # the 8-token tiles and each remainder tile (1-7, which take 4, 2 or 1 panels side by side), the
    # 64-token blocks of matmul.cpp; row counts the panels left over after those side-by-side groups.
    rng = np.random.default_rng(5)
    for simd in ROWS16_LEVELS:
        for rows, cols, n_tokens in ((16, 32, 1), (80, 64, 1), (112, 64, 2), (48, 96, 3), (208, 64, 4), (32, 512, 5),
                                     (96, 64, 6), (64, 128, 7), (48, 576, 8), (32, 256, 13), (160, 64, 40),
                                     (16, 64, 70)):
            w = _weights(rows, cols, qtype, seed=rows + n_tokens)
            x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
            w16 = quant.rows16(w, qtype, cols)
            assert not np.array_equal(w16, w) and w16.shape == w.shape  # a permutation of the same bytes
            y = quant.matmul(w16, qtype, x, n_threads=2, simd=simd, rows16=True)
            ref = np.array([[quant.dot(w[r], qtype, x[t], simd=simd) for r in range(rows)] for t in range(n_tokens)],
                           np.float32)
            np.testing.assert_array_equal(y, ref, err_msg=f"{simd}: {rows} rows x {n_tokens} tokens")


@pytest.mark.parametrize("qtype", ROWS16_TYPES)
def test_rows16_layout_round_trip_and_rows(qtype):
    # Back to rows gives the very bytes; one row read out of the layout dequantizes as its own row does
    # (gguf-py's dequantization is the independent reference).
    from gguf.quants import dequantize as gguf_dequantize
    from gguf import GGMLQuantizationType

    rows, cols = 48, 96
    w = _weights(rows, cols, qtype, seed=3)
    w16 = quant.rows16(w, qtype, cols)
    np.testing.assert_array_equal(quant.rows16(w16, qtype, cols, back=True), w)
    ref = gguf_dequantize(w, GGMLQuantizationType[qtype.upper()])
    for r in (0, 15, 16, 47):
        np.testing.assert_array_equal(optiml._core.rows16_row(w16, quant.type_id(qtype), cols, r), ref[r])


def test_rows16_rejects_what_it_cannot_hold():
    with pytest.raises(optiml.ArgumentError, match="no rows16 layout"):
        quant.rows16(_weights(16, 256, "q4_k"), "q4_k", 256)
    with pytest.raises(optiml.ArgumentError, match="no rows16 layout"):
        quant.rows16(_weights(16, 256, "mxfp4"), "mxfp4", 256)
    with pytest.raises(optiml.ArgumentError, match="no rows16 layout"):
        quant.rows16(_weights(20, 64, "q4_0"), "q4_0", 64)  # rows not a multiple of 16
    w16 = quant.rows16(_weights(16, 64, "q4_0"), "q4_0", 64)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(optiml.ArgumentError, match="no rows16 product"):
        quant.matmul(w16, "q4_0", x, simd="scalar", rows16=True)
