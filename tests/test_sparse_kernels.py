"""Kernels of the activation-sparse FFN (native/src/cpu/sparse*.cpp), through optiml._core.

  * matmul_rows equals the dense matmul restricted to the listed rows, bit for bit, for every
    weight type, SIMD level and thread count (unlisted rows stay 0 in the binding's output);
  * repack_neuron_major is the transpose of the dequantized down matrix, requantized row by row:
    exactly equal for an F32 target, and byte-identical to quantizing the transpose for F16/Q8_0;
  * axpy_rows equals a float64 numpy reference within a derived bound, and is bit-identical across
    thread counts and SIMD levels (every level computes each output as the same fma chain); over the
    grouped 4-bit copy, against float64 references of its int8-quantized math and of the float
    product, within bounds derived from the final float steps and the int8 rounding;
  * bad input raises optiml.ArgumentError.
"""

import numpy as np
import pytest

import optiml
from optiml import _core, quant

TYPES = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
LEVELS = _core.simd_levels()  # scalar and whatever this CPU and build add
THREADS = (1, 2)
F32, F16, Q8_0 = 0, 1, 8
U = 2.0**-24  # unit roundoff of float32


def _weights(rows, cols, qtype, seed):
    rng = np.random.default_rng(seed)
    return quant.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)


def _row_subsets(rows, rng):
    """Empty, one row, all rows (shuffled) and a random unsorted subset, all duplicate-free."""
    return [
        np.zeros(0, np.int32),
        np.array([rows - 1], np.int32),
        rng.permutation(rows).astype(np.int32),
        rng.choice(rows, size=rows // 3, replace=False).astype(np.int32),
    ]


# ---- matmul_rows -------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_rows_equals_dense_rows_bit_for_bit(qtype):
    rows, cols = 70, 512
    w = _weights(rows, cols, qtype, seed=1)
    t = quant.type_id(qtype)
    rng = np.random.default_rng(2)
    for n_tokens in (1, 5):
        x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
        for simd in LEVELS:
            dense = quant.matmul(w, qtype, x, n_threads=1, simd=simd)
            for idx in _row_subsets(rows, rng):
                for n in THREADS:
                    y = _core.matmul_rows(w, t, rows, cols, idx, x, n_threads=n, simd=simd)
                    assert y.shape == (n_tokens, rows) and y.dtype == np.float32
                    np.testing.assert_array_equal(y[:, idx], dense[:, idx])
                    rest = np.setdiff1d(np.arange(rows), idx)
                    assert not y[:, rest].any()


def test_matmul_rows_many_rows_many_threads():
    # Enough rows that several chunks go to each thread (chunk size 16..64).
    rows, cols = 1500, 256
    w = _weights(rows, cols, "q4_0", seed=3)
    rng = np.random.default_rng(4)
    idx = rng.choice(rows, size=900, replace=False).astype(np.int32)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    dense = quant.matmul(w, "q4_0", x, n_threads=1)
    for n in (1, 2, 3, 5):
        y = _core.matmul_rows(w, 2, rows, cols, idx, x, n_threads=n)
        np.testing.assert_array_equal(y[:, idx], dense[:, idx])


# ---- repack_neuron_major -----------------------------------------------------------------------
def _cols_for(qtype):
    # Not a whole number of 256-column tiles where the block size allows, to exercise partial tiles.
    return 768 if quant.type_info(qtype).block_size == 256 else 800


@pytest.mark.parametrize("qtype", TYPES)
def test_repack_f32_is_the_transposed_dequantized_matrix(qtype):
    rows, cols = 150, _cols_for(qtype)  # rows = n_embd: not a multiple of the 64-row tile
    w = _weights(rows, cols, qtype, seed=5)
    want = quant.dequantize(w, qtype).T
    for n in THREADS:
        nm, row_bytes, scale = _core.repack_neuron_major(w, quant.type_id(qtype), rows, cols, F32, n_threads=n)
        assert scale is None
        assert row_bytes == rows * 4 and nm.shape == (cols, row_bytes) and nm.dtype == np.uint8
        np.testing.assert_array_equal(nm.view(np.float32), want)


@pytest.mark.parametrize("qtype", ["f32", "f16", "q4_0", "q5_1", "q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("target", ["f16", "q8_0"])
def test_repack_quantized_targets_match_quantizing_the_transpose(qtype, target):
    rows, cols = 160, _cols_for(qtype)
    w = _weights(rows, cols, qtype, seed=6)
    wt = np.ascontiguousarray(quant.dequantize(w, qtype).T)  # [n_ff, n_embd]
    want_scale = None
    if target == "q8_0":  # each output dimension scaled to a largest |weight| of 1 first
        want_scale = np.abs(wt).max(axis=0)
        wt = np.ascontiguousarray(wt * (np.float32(1) / want_scale))
    want = quant.quantize(wt, target)
    first = None
    for n in THREADS:
        nm, row_bytes, scale = _core.repack_neuron_major(w, quant.type_id(qtype), rows, cols, quant.type_id(target),
                                                         n_threads=n)
        assert row_bytes == want.shape[1]
        if target == "f16":
            np.testing.assert_array_equal(nm, want)
        else:  # the fast converter rounds x * (127 / amax); the reference x / (amax / 127): ties may differ
            got, ref = quant.dequantize(nm, target), quant.dequantize(want, target)
            np.testing.assert_array_equal(nm.reshape(-1, 34)[:, :2], want.reshape(-1, 34)[:, :2])  # the scales
            assert np.mean(got == ref) > 0.999
            np.testing.assert_array_less(np.abs(got - wt), _requant_error(wt, target) + 1e-12)
        first = nm if first is None else first
        np.testing.assert_array_equal(nm, first)  # independent of the thread count
        if want_scale is None:
            assert scale is None
        else:
            np.testing.assert_array_equal(scale, want_scale)


# ---- axpy_rows ---------------------------------------------------------------------------------
def _requant_error(wt, target):
    """Per-element bound on |requantized - original| for neuron-major rows wt [n_neurons, dim]."""
    if target == "f32":
        return np.zeros_like(wt, dtype=np.float64)
    if target == "f16":
        return np.abs(wt).astype(np.float64) * 2.0**-11  # round to nearest, 11-bit significand
    # Q8_0: d = amax/127, q = round(x / d): |x - q d| <= d/2, and d stored as f16 adds |q| d 2^-11.
    amax = np.abs(wt.reshape(wt.shape[0], -1, 32)).max(axis=2).astype(np.float64)
    d = amax / 127
    return np.repeat(d * (0.5 + 127 * 2.0**-11) * (1 + 1e-6), 32, axis=1)


@pytest.mark.parametrize("target", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("qtype", ["f16", "q4_0", "q8_0", "q4_k"])
def test_axpy_rows_matches_float64_reference(qtype, target):
    n_embd, n_ff = 224, 512  # dim = n_embd: 7 units of 32, so 2 threads get unequal slices
    w = _weights(n_embd, n_ff, qtype, seed=7)
    wt = quant.dequantize(w, qtype).T.astype(np.float64)  # [n_ff, n_embd], column j of down = neuron j
    tt = quant.type_id(target)
    nm, _, scale = _core.repack_neuron_major(w, quant.type_id(qtype), n_embd, n_ff, tt)
    sc = np.ones(n_embd) if scale is None else scale.astype(np.float64)
    stored = quant.dequantize(nm, target).astype(np.float64)  # what axpy actually reads ...
    nm_vals = stored * sc  # ... and what it means once the per-dimension scale is applied
    err = _requant_error((quant.dequantize(w, qtype).T / sc).astype(np.float32), target) * sc
    rng = np.random.default_rng(8)
    subsets = [np.zeros(0, np.int32), np.array([3], np.int32), rng.permutation(n_ff).astype(np.int32)]
    subsets += [rng.choice(n_ff, size=k, replace=False).astype(np.int32) for k in (2, 5, 51)]
    for idx in subsets:
        a = rng.standard_normal(len(idx)).astype(np.float32)
        a64 = a.astype(np.float64)
        y = _core.axpy_rows(nm, tt, n_ff, n_embd, idx, a, dim_scale=scale)
        assert y.shape == (n_embd,) and y.dtype == np.float32
        # Against the rows as stored: one rounding per fma (plus the product a * d for Q8_0 blocks,
        # and the final scaling), so |error| <= (k + 3) u sum |a w| to first order.
        mag = np.abs(a64) @ np.abs(nm_vals[idx]) if len(idx) else np.zeros(n_embd)
        bound = (len(idx) + 3) * U * mag + 1e-30
        assert np.all(np.abs(y - a64 @ nm_vals[idx]) <= bound)
        # Against the original down matrix: add the requantization error of each active column.
        ref = a64 @ wt[idx] if len(idx) else np.zeros(n_embd)
        req = np.abs(a64) @ err[idx] if len(idx) else np.zeros(n_embd)
        assert np.all(np.abs(y - ref) <= bound + req)
        # Same bits for every thread count and SIMD level.
        for simd in LEVELS:
            for n in (1, 2, 3):
                np.testing.assert_array_equal(
                    _core.axpy_rows(nm, tt, n_ff, n_embd, idx, a, n_threads=n, simd=simd, dim_scale=scale), y)


@pytest.mark.parametrize("target", ["f32", "f16", "q8_0"])
def test_axpy_rows_accumulates_into_y(target):
    n_embd, n_ff = 4096 if target == "q8_0" else 4100, 64  # f32/f16 rows may end mid-vector
    rng = np.random.default_rng(9)
    tt = quant.type_id(target)
    wt = rng.standard_normal((n_ff, n_embd)).astype(np.float32)
    nm = quant.quantize(wt, target)
    vals = quant.dequantize(nm, target).astype(np.float64)
    idx = rng.choice(n_ff, size=13, replace=False).astype(np.int32)
    a = rng.standard_normal(13).astype(np.float32)
    y0 = rng.standard_normal(n_embd).astype(np.float32)
    y = _core.axpy_rows(nm, tt, n_ff, n_embd, idx, a, y=y0)
    ref = y0.astype(np.float64) + a.astype(np.float64) @ vals[idx]
    mag = np.abs(y0) + np.abs(a.astype(np.float64)) @ np.abs(vals[idx])
    assert np.all(np.abs(y - ref) <= 15 * U * mag)
    for simd in LEVELS:
        for n in (1, 2, 3):
            np.testing.assert_array_equal(_core.axpy_rows(nm, tt, n_ff, n_embd, idx, a, y=y0, n_threads=n, simd=simd), y)


# ---- grouped rows: the lossless 4-bit copy of a Q4_0/Q4_1/Q4_K down matrix --------------------------
def _grouped_parts(w, qtype, n_embd, n_ff):
    """The grouped copy's parts as float64: codes (centred for Q4_0) [n_ff, n_embd], and per neuron its
    group's scales and minimums [n_ff, n_embd]."""
    codes, group, gd, gm = _core.repack_neuron_major_grouped(w, quant.type_id(qtype), n_embd, n_ff)
    assert codes.shape == (n_ff, n_embd // 2) and group.shape == (n_ff,)
    c = np.empty((n_ff, n_embd), np.float64)
    for k in range(n_embd // 32):  # 16 bytes per 32 dimensions: low nibbles 0-15, high nibbles 16-31
        chunk = codes[:, 16 * k:16 * k + 16]
        c[:, 32 * k:32 * k + 16] = chunk & 0x0F
        c[:, 32 * k + 16:32 * k + 32] = chunk >> 4
    if qtype == "q4_0":
        c -= 8
    d = gd.astype(np.float64)[group]
    m = np.zeros_like(d) if gm is None else gm.astype(np.float64)[group]
    return c, d, m, group


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q4_k"])
def test_grouped_copy_is_the_file_matrix_exactly(qtype):
    from gguf import GGMLQuantizationType, quants

    n_embd, n_ff = 96, 512
    w = _weights(n_embd, n_ff, qtype, seed=21)
    # gguf-py's dequantization is the independent oracle of what the file's matrix means.
    ref = quants.dequantize(w.reshape(n_embd, -1), GGMLQuantizationType[qtype.upper()]).astype(np.float64)
    c, d, m, group = _grouped_parts(w, qtype, n_embd, n_ff)
    np.testing.assert_array_equal(group, np.arange(n_ff) // 32)
    # Every weight as the file means it, to the last bit of gguf-py's float32 result: nothing is
    # requantized (Q4_K's d * sc * code - dmin * m rounds once in float32 there, never here).
    np.testing.assert_array_equal((d * c + m).astype(np.float32), ref.T.astype(np.float32))


def _grouped_case(qtype, n_embd, n_ff, seed):
    """A test's type id, weights (from seed) and their grouped parts, and its inputs' generator (seed + 1)."""
    w = _weights(n_embd, n_ff, qtype, seed=seed)
    return quant.type_id(qtype), w, _grouped_parts(w, qtype, n_embd, n_ff), np.random.default_rng(seed + 1)


MAX_GROUP_RUN = 1024  # kMaxGroupRun (kernels.h): a group's neurons are quantized this many at a time


def _grouped_quantized(idx, a, group):
    """The coefficients as axpy_rows_grouped quantizes them, independently of it: neurons sorted by
    group (stable), a group's neurons MAX_GROUP_RUN at a time; per such run s = max|a| / 127 and
    q = roundf(a * (1 / s)) in float32 (half away from zero). Returns q (float64, list order), each
    neuron's run scale s (float32) and the runs (arrays of list positions); all-zero runs are left out."""
    q = np.zeros(len(idx))
    s = np.zeros(len(idx), np.float32)
    order = np.argsort(group[idx], kind="stable")
    runs = []
    for g in np.unique(group[idx]):
        members = order[group[idx][order] == g]
        for at in range(0, len(members), MAX_GROUP_RUN):
            run = members[at:at + MAX_GROUP_RUN]
            amax = np.max(np.abs(a[run]))
            if amax == 0:
                continue
            sc = np.float32(amax) / np.float32(127)
            v = (a[run] * (np.float32(1) / sc)).astype(np.float64)  # float32 product, as the kernel
            q[run] = np.sign(v) * np.floor(np.abs(v) + 0.5)
            s[run] = sc
            runs.append(run)
    assert np.all(np.abs(q) <= 127)
    return q, s, runs


def _grouped_check(y, y0, idx, a, c, d, m, group):
    """Asserts y against two float64 references of y0 + sum_i a[i] * W[idx[i]] (W = d * c + m, the
    file's weights: test_grouped_copy_is_the_file_matrix_exactly).
      * the quantized math itself: per run t[r] = sum q_i c_i[r] exactly (integers), then
        y += f32(d * s) * t (+ m * f32(s * sum q)). The products d * s and s * sum q are formed in float32
        here as in the kernel, so the only roundings left are the kernel's fma's into y, one or two per
        run: |error| <= (steps + 1) u (|y0| + sum of the terms' magnitudes);
      * the float coefficients: each |q s - a| <= s / 2 (plus the float32 rounding of a * (1 / s), a
        relative 2^-23 of |a / s| <= 127: 2^-16 s), so the int8 rounding adds at most
        sum_i 0.50002 s_i |W[idx[i]]|, and the two float32 products above a relative u each."""
    q, s, runs = _grouped_quantized(idx, a, group)
    y0 = np.zeros(len(y)) if y0 is None else y0.astype(np.float64)
    exact, mag = y0.copy(), np.abs(y0)
    has_min = np.any(m != 0)
    for run in runs:
        i0 = idx[run[0]]
        t = q[run] @ c[idx[run]]  # integers below 2^53: exact
        ds = (d[i0].astype(np.float32) * s[run[0]]).astype(np.float64)
        ms = np.float64(np.float32(s[run[0]]) * np.float32(q[run].sum()))
        exact += ds * t + m[i0] * ms
        mag += np.abs(ds * t) + np.abs(m[i0] * ms)
    steps = len(runs) * (2 if has_min else 1)
    assert np.all(np.abs(y - exact) <= (steps + 1) * U * mag + 1e-30)
    W = d * c + m
    ref = y0 + (a.astype(np.float64) @ W[idx] if len(idx) else 0)
    int8 = (0.50002 * s.astype(np.float64)) @ np.abs(W[idx]) if len(idx) else 0
    assert np.all(np.abs(y - ref) <= int8 + (steps + 3) * U * mag + 1e-30)
    return exact


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q4_k"])
def test_grouped_axpy_matches_float64_reference(qtype):
    n_embd, n_ff = 224, 512  # 7 units of 32: 2 and 3 threads get unequal slices
    tid, w, (c, d, m, group), rng = _grouped_case(qtype, n_embd, n_ff, 22)
    subsets = [np.zeros(0, np.int32), np.array([3], np.int32),  # no neuron, one neuron
               rng.permutation(np.arange(64, 96)).astype(np.int32),  # one full group, shuffled
               rng.permutation(n_ff).astype(np.int32)]  # every neuron
    subsets += [rng.choice(n_ff, size=k, replace=False).astype(np.int32) for k in (2, 5, 17, 51)]
    for idx in subsets:
        a = rng.standard_normal(len(idx)).astype(np.float32)
        y = _core.axpy_rows_grouped(w, tid, n_embd, n_ff, idx, a)
        assert y.shape == (n_embd,) and y.dtype == np.float32
        _grouped_check(y, None, idx, a, c, d, m, group)
        for simd in LEVELS:
            for n in (1, 2, 3):
                np.testing.assert_array_equal(
                    _core.axpy_rows_grouped(w, tid, n_embd, n_ff, idx, a, n_threads=n, simd=simd), y)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q4_k"])
def test_grouped_axpy_coefficient_edge_cases(qtype):
    n_embd, n_ff = 96, 256
    tid, w, (c, d, m, group), rng = _grouped_case(qtype, n_embd, n_ff, 27)
    y0 = rng.standard_normal(n_embd).astype(np.float32)
    # A group whose coefficients are all zero adds nothing: y keeps its bits, alone or beside others.
    zeros = np.arange(32, 40, dtype=np.int32)
    np.testing.assert_array_equal(
        _core.axpy_rows_grouped(w, tid, n_embd, n_ff, zeros, np.zeros(8, np.float32), y=y0), y0)
    idx = np.concatenate([zeros, np.array([0, 200, 7], np.int32)])
    a = np.concatenate([np.zeros(8, np.float32), rng.standard_normal(3).astype(np.float32)])
    y = _core.axpy_rows_grouped(w, tid, n_embd, n_ff, idx, a, y=y0)
    np.testing.assert_array_equal(y, _core.axpy_rows_grouped(w, tid, n_embd, n_ff, idx[8:], a[8:], y=y0))
    _grouped_check(y, y0, idx, a, c, d, m, group)
    # Coefficients spanning decades: the small ones of a group round to 0 against its largest (as in
    # a Q8_0 block of activations), within the bound the int8 rounding explains.
    idx = np.arange(64, 96, dtype=np.int32)
    a = (rng.standard_normal(32) * 10.0 ** rng.integers(-6, 2, 32)).astype(np.float32)
    _grouped_check(_core.axpy_rows_grouped(w, tid, n_embd, n_ff, idx, a), None, idx, a, c, d, m, group)
    # One neuron listed 1100 times: the group is quantized in runs of MAX_GROUP_RUN, whose integer sums
    # stay exact in float; every level and thread count gives the same bits.
    idx = np.full(1100, 5, np.int32)
    a = rng.standard_normal(1100).astype(np.float32)
    y = _core.axpy_rows_grouped(w, tid, n_embd, n_ff, idx, a)
    _grouped_check(y, None, idx, a, c, d, m, group)
    for simd in LEVELS:
        np.testing.assert_array_equal(_core.axpy_rows_grouped(w, tid, n_embd, n_ff, idx, a, n_threads=2, simd=simd), y)
    # A non-finite coefficient makes its group's outputs NaN (not a crash, not a silent finite value).
    for bad in (np.nan, np.inf):
        a = np.array([1.0, bad], np.float32)
        for simd in LEVELS:
            y = _core.axpy_rows_grouped(w, tid, n_embd, n_ff, np.array([0, 1], np.int32), a, simd=simd)
            assert np.all(np.isnan(y))


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q4_k"])
def test_grouped_axpy_over_a_neuron_subset_and_into_y(qtype):
    n_embd, n_ff = 128, 256
    tid, w, (c, d, m, group), rng = _grouped_case(qtype, n_embd, n_ff, 24)
    subset = rng.permutation(n_ff)[:100].astype(np.int32)  # a host share: unsorted, groups scattered
    idx = rng.choice(100, size=37, replace=False).astype(np.int32)
    a = rng.standard_normal(37).astype(np.float32)
    y0 = rng.standard_normal(n_embd).astype(np.float32)
    y = _core.axpy_rows_grouped(w, tid, n_embd, n_ff, idx, a, y=y0, subset=subset)
    _grouped_check(y, y0, subset[idx], a, c, d, m, group)
    # The subset's copy computes what the whole copy computes for the same neurons in the same order.
    np.testing.assert_array_equal(_core.axpy_rows_grouped(w, tid, n_embd, n_ff, subset[idx], a, y=y0), y)
    for simd in LEVELS:
        np.testing.assert_array_equal(
            _core.axpy_rows_grouped(w, tid, n_embd, n_ff, idx, a, y=y0, subset=subset, n_threads=2, simd=simd), y)


def test_grouped_bad_input_raises_argument_error():
    E = optiml.ArgumentError
    w8 = _weights(64, 256, "q8_0", seed=26)
    with pytest.raises(E, match="Q4_0, Q4_1 or Q4_K"):
        _core.repack_neuron_major_grouped(w8, quant.type_id("q8_0"), 64, 256)
    w = _weights(64, 256, "q4_0", seed=26)
    tid = quant.type_id("q4_0")
    one = np.ones(1, np.float32)
    for bad in (-1, 256):
        with pytest.raises(E, match="outside"):
            _core.axpy_rows_grouped(w, tid, 64, 256, np.array([bad], np.int32), one)
    with pytest.raises(E, match="outside"):
        _core.axpy_rows_grouped(w, tid, 64, 256, np.array([0], np.int32), one, subset=np.array([300], np.int32))
    with pytest.raises(E, match="outside"):  # idx indexes the subset: 2 rows only
        _core.axpy_rows_grouped(w, tid, 64, 256, np.array([2], np.int32), one, subset=np.array([0, 1], np.int32))


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_input_raises_argument_error():
    rows, cols = 64, 256
    w = _weights(rows, cols, "q4_0", seed=10)
    x = np.ones((2, cols), np.float32)
    ok = np.array([0, 5], np.int32)
    E = optiml.ArgumentError
    # matmul_rows
    for bad in ([-1], [0, rows], [2**31 - 1]):
        with pytest.raises(E, match="outside"):
            _core.matmul_rows(w, 2, rows, cols, np.array(bad, np.int32), x)
    with pytest.raises(E, match="bytes"):
        _core.matmul_rows(w, 2, rows + 1, cols, ok, x)
    with pytest.raises(E, match="columns"):
        _core.matmul_rows(w, 2, rows, cols, ok, np.ones((2, cols - 32), np.float32))
    with pytest.raises(E, match="type"):
        _core.matmul_rows(w, 5, rows, cols, ok, x)
    with pytest.raises(E, match="SIMD"):
        _core.matmul_rows(w, 2, rows, cols, ok, x, simd="sse9")
    with pytest.raises(E, match="multiple"):
        _core.matmul_rows(w, 2, rows, 48, ok, np.ones((2, 48), np.float32))
    # repack_neuron_major
    with pytest.raises(E, match="F32, F16 or Q8_0"):
        _core.repack_neuron_major(w, 2, rows, cols, 2)
    w40 = _weights(40, cols, "q4_0", seed=11)
    with pytest.raises(E, match="multiple of 32"):
        _core.repack_neuron_major(w40, 2, 40, cols, Q8_0)
    with pytest.raises(E, match="bytes"):
        _core.repack_neuron_major(w, 2, rows, cols * 2, Q8_0)
    # axpy_rows
    nm, _, _ = _core.repack_neuron_major(w, 2, rows, cols, Q8_0)  # cols neurons of dim rows
    a = np.ones(2, np.float32)
    for bad in ([-1, 0], [0, cols]):
        with pytest.raises(E, match="outside"):
            _core.axpy_rows(nm, Q8_0, cols, rows, np.array(bad, np.int32), a)
    with pytest.raises(E, match="coefficients"):
        _core.axpy_rows(nm, Q8_0, cols, rows, ok, np.ones(3, np.float32))
    with pytest.raises(E, match="bytes"):
        _core.axpy_rows(nm, Q8_0, cols + 1, rows, ok, a)
    with pytest.raises(E, match="F32, F16 or Q8_0"):
        _core.axpy_rows(nm, 2, cols, rows, ok, a)
    with pytest.raises(E, match="multiple of 32"):
        _core.axpy_rows(nm, Q8_0, cols, 48, ok, a)
    with pytest.raises(E, match="dim"):
        _core.axpy_rows(nm, Q8_0, cols, rows, ok, a, y=np.zeros(rows + 1, np.float32))
