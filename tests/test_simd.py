"""SIMD kernels against the scalar reference and an independent numpy model.

For every SIMD level this CPU and build have (other than scalar):
  * vec_dot of each weight type with a converted activation equals the scalar level's result and a
    float64 numpy dot of the dequantized operands, within a bound derived from float summation;
  * activation conversion (Q8_0, Q8_1, Q8_K, F16, BF16) is byte-identical to scalar and to a numpy
    model of the scalar contract, including exact .5 ties, zeros, constants, tiny and huge values;
  * matmul at the level (the batched kernel for several tokens) equals matmul at the scalar level
    within the same bound.
"""
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402

from optiml import _core  # noqa: E402
from test_quant import activation_values  # noqa: E402  (an independent numpy decoding)

LEVELS = [lv for lv in _core.simd_levels() if lv != "scalar"]

# name -> (ggml type id, block size, bytes per block, activation type name, offsets of fp16 fields)
WTYPES = {
    "F32": (0, 1, 4, "F32", ()),
    "F16": (1, 1, 2, "F16", ()),
    "BF16": (30, 1, 2, "BF16", ()),
    "Q4_0": (2, 32, 18, "Q8_0", (0,)),
    "Q4_1": (3, 32, 20, "Q8_1", (0, 2)),
    "Q5_0": (6, 32, 22, "Q8_0", (0,)),
    "Q5_1": (7, 32, 24, "Q8_1", (0, 2)),
    "Q8_0": (8, 32, 34, "Q8_0", (0,)),
    "MXFP4": (39, 32, 17, "Q8_0", ()),  # its E8M0 scale byte is set apart (random_weights)
    "Q2_K": (10, 256, 84, "Q8_K", (80, 82)),
    "Q3_K": (11, 256, 110, "Q8_K", (108,)),
    "Q4_K": (12, 256, 144, "Q8_K", (0, 2)),
    "Q5_K": (13, 256, 176, "Q8_K", (0, 2)),
    "Q6_K": (14, 256, 210, "Q8_K", (208,)),
}
ACT_BLOCK = {"F32": 1, "F16": 1, "BF16": 1, "Q8_0": 32, "Q8_1": 32, "Q8_K": 256}
# a weight type that converts activations to each activation type
ACT_VIA = {"Q8_0": "Q8_0", "Q8_1": "Q4_1", "Q8_K": "Q4_K", "F16": "F16", "BF16": "BF16"}


def lengths(name):
    bs = max(WTYPES[name][1], ACT_BLOCK[WTYPES[name][3]])
    if bs == 1:
        return [1, 7, 32, 33, 100, 4096, 4103]
    if bs == 32:
        return [32, 64, 96, 352, 4096]
    return [256, 512, 2816, 11008]


# ---- numpy models ------------------------------------------------------------------------------
def bf16_bits(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    return np.where(nan, (u >> 16) | 64, r).astype(np.uint16)


def ref_q8(x):
    """Q8_0/Q8_1 activations: per 32 block d = amax/127, q = rint(x * (127/amax)) (ties to even)."""
    xb = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((xb * inv[:, None]).astype(np.float32)).astype(np.int8)
    return d, q


def ref_convert(x, act):
    x = np.ascontiguousarray(x, dtype=np.float32)
    if act == "F16":
        return x.astype(np.float16).view(np.uint8)
    if act == "BF16":
        return bf16_bits(x).view(np.uint8)
    if act == "Q8_0":
        d, q = ref_q8(x)
        out = np.zeros((len(d), 34), np.uint8)
        out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        out[:, 2:] = q.view(np.uint8)
        return out.ravel()
    if act == "Q8_1":
        d, q = ref_q8(x)
        s = (d * q.astype(np.int32).sum(axis=1).astype(np.float32)).astype(np.float32)
        out = np.zeros((len(d), 36), np.uint8)
        out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        out[:, 2:4] = s.astype(np.float16).view(np.uint8).reshape(-1, 2)
        out[:, 4:] = q.view(np.uint8)
        return out.ravel()
    if act == "Q8_K":
        xb = x.reshape(-1, 256)
        out = np.zeros((len(xb), 292), np.uint8)
        for i, blk in enumerate(xb):
            mx = blk[np.argmax(np.abs(blk))]
            if mx == 0:
                continue
            iscale = np.float32(-127) / mx
            q = np.minimum(np.rint((blk * iscale).astype(np.float32)), 127).astype(np.int8)
            out[i, 0:4] = np.array([np.float32(1) / iscale], np.float32).view(np.uint8)
            out[i, 4:260] = q.view(np.uint8)
            out[i, 260:] = q.astype(np.int16).reshape(16, 16).sum(axis=1).astype(np.int16).view(np.uint8)
        return out.ravel()
    raise AssertionError(act)


def random_weights(name, n, rng, rows=1):
    tid, bs, ts, _, f16 = WTYPES[name]
    if name == "F32":
        return rng.standard_normal((rows, n)).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.standard_normal((rows, n)).astype(np.float16).view(np.uint8)
    if name == "BF16":
        return bf16_bits(rng.standard_normal((rows, n)).astype(np.float32)).view(np.uint8)
    nb = rows * n // bs
    b = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    for off in f16:  # sane positive/negative fp16 scales
        b[:, off:off + 2] = (rng.uniform(0.5, 2.0, nb) * 1e-2 * rng.choice([-1, 1], nb)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":  # E8M0 scales 2^-9 .. 2^-1 (half-scales of the doubled table values)
        b[:, 0] = rng.integers(119, 127, nb)
    return b.reshape(rows, -1)


def dequant_weights(name, w_row):
    if name == "F32":
        return w_row.view(np.float32).astype(np.float64)
    if name == "F16":
        return w_row.view(np.float16).astype(np.float64)
    if name == "BF16":
        return activation_values(w_row, "BF16", 0)
    return gguf.quants.dequantize(w_row, GT[name]).astype(np.float64).ravel()


def activations(n, rng):
    return (rng.standard_normal(n) * rng.uniform(0.1, 3.0)).astype(np.float32)


def scalar_has(name):
    try:
        _core.vec_dot_converted(WTYPES[name][0], np.zeros(1, np.uint8), np.zeros(1, np.uint8), 1, "scalar")
    except Exception as e:  # noqa: BLE001
        return "no dot-product kernel" not in str(e)
    return True


# ---- vec_dot -------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(WTYPES))
def test_vec_dot(level, name):
    rng = np.random.default_rng(zlib.crc32(f"{level}{name}".encode()))
    tid, _, _, act, _ = WTYPES[name]
    have_scalar = scalar_has(name)
    for n in lengths(name):
        for _ in range(3):
            w = random_weights(name, n, rng)[0]
            x = activations(n, rng)
            xq = x.view(np.uint8) if act == "F32" else _core.convert_activation(x, tid, level)
            got = _core.vec_dot_converted(tid, w, xq, n, level)
            terms = dequant_weights(name, w) * activation_values(xq, act, n)
            if act == "Q8_1":
                # The min term uses the stored fp16 s = d*sum(q), not the exact d*sum(q): m*(s - d*sum q).
                m = w.reshape(-1, WTYPES[name][2])[:, 2:4].copy().view(np.float16).astype(np.float64).ravel()
                xb = xq.reshape(-1, 36)
                s = xb[:, 2:4].copy().view(np.float16).astype(np.float64).ravel()
                exact = activation_values(xq, act, n).reshape(-1, 32).sum(axis=1)
                terms = np.concatenate([terms, m * (s - exact)])
            bound = 2e-5 * np.abs(terms).sum() + 1e-6
            assert abs(got - terms.sum()) <= bound, (name, n, got, terms.sum())
            if have_scalar:
                ref = _core.vec_dot_converted(tid, w, xq, n, "scalar")
                assert abs(got - ref) <= bound, (name, n, got, ref)


# ---- attention's dots over many rows ----------------------------------------------------------------
@pytest.mark.parametrize("level", _core.simd_levels())
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_attn_dot_rows_equal_each_row_alone(level, dtype):
    """Attention dots K rows against q and V's dimension rows against the weights many rows at once; every
    row must keep the bits it has alone, and both must agree with a float64 sum."""
    rng = np.random.default_rng(7)
    tid = WTYPES["F16"][0] if dtype == np.float16 else WTYPES["F32"][0]
    for n in (16, 33, 64, 96, 160, 256):
        for n_rows in (1, 3, 4, 5, 9, 64):
            stride = n + 11
            rows = rng.standard_normal(stride * n_rows).astype(dtype)
            y = rng.standard_normal(n).astype(dtype)
            args = (tid, rows.view(np.uint8), stride, y.view(np.uint8), n, n_rows)
            together = _core.attn_dot_rows(*args, together=True, simd=level)
            alone = _core.attn_dot_rows(*args, together=False, simd=level)
            np.testing.assert_array_equal(together.view(np.uint32), alone.view(np.uint32), err_msg=f"n={n} rows={n_rows}")
            m = np.lib.stride_tricks.as_strided(rows, (n_rows, n), (stride * rows.itemsize, rows.itemsize))
            terms = m.astype(np.float64) * y.astype(np.float64)
            bound = 2e-5 * np.abs(terms).sum(axis=1) + 1e-6
            assert (np.abs(together - terms.sum(axis=1)) <= bound).all(), (n, n_rows)
    with pytest.raises(_core.ArgumentError, match="F16 or F32"):
        _core.attn_dot_rows(WTYPES["Q8_0"][0], np.zeros(64, np.uint8), 16, np.zeros(32, np.uint8), 16, 1)


@pytest.mark.parametrize("level", _core.simd_levels())
def test_attn_dot_heads_equal_each_head_alone(level):
    """The query heads that share a KV head go through its rows together (keys against the queries, V's
    dimension rows against each head's weights); every (row, head) must keep the bits of attn_dot alone,
    for head counts that fill the 4-head tiles or not, rows left over, and lengths with scalar tails."""
    rng = np.random.default_rng(11)
    for n in (16, 33, 64, 96, 128, 160, 256):
        for n_rows in (1, 3, 4, 9):
            for n_y in (1, 2, 3, 4, 5, 8, 9):
                stride = n + 5
                rows = rng.standard_normal(stride * n_rows).astype(np.float16)
                ys = rng.standard_normal(n * n_y).astype(np.float16)
                got = _core.attn_dot_heads(rows.view(np.uint8), stride, ys.view(np.uint8), n, n_rows, n_y, simd=level)
                assert got.shape == (n_y, n_rows)
                for q in range(n_y):
                    alone = _core.attn_dot_rows(WTYPES["F16"][0], rows.view(np.uint8), stride,
                                                ys[q * n:(q + 1) * n].view(np.uint8), n, n_rows, together=False,
                                                simd=level)
                    np.testing.assert_array_equal(got[q].view(np.uint32), alone.view(np.uint32),
                                                  err_msg=f"n={n} rows={n_rows} heads={n_y} head {q}")
                m = np.lib.stride_tricks.as_strided(rows, (n_rows, n), (stride * 2, 2)).astype(np.float64)
                exact = ys.reshape(n_y, n).astype(np.float64) @ m.T
                bound = 2e-5 * (np.abs(ys.reshape(n_y, n).astype(np.float64)) @ np.abs(m).T) + 1e-6
                assert (np.abs(got - exact) <= bound).all(), (n, n_rows, n_y)
    with pytest.raises(_core.ArgumentError, match="ys holds"):
        _core.attn_dot_heads(np.zeros(64, np.uint8), 16, np.zeros(32, np.uint8), 16, 1, 2)


# ---- activation conversion -----------------------------------------------------------------------
def conversion_inputs(n, rng, act):
    yield activations(n, rng)
    yield np.zeros(n, np.float32)
    yield np.full(n, 0.7, np.float32)
    yield np.full(n, -3.25, np.float32)
    yield (rng.standard_normal(n) * 1e-30).astype(np.float32)  # tiny, fp16 d underflows
    if act in ("F16", "BF16"):
        # denormal floats (for the int8 types 1/d overflows there and the scalar cast is undefined)
        yield (rng.standard_normal(n) * 1e-42).astype(np.float32)
    yield (rng.standard_normal(n) * 1e30).astype(np.float32)  # huge, fp16 d overflows
    yield (rng.integers(-200, 200, n) * 0.5).astype(np.float32)  # many .5 values
    # Exact ties: amax 127 gives d = 1 and 1/d = 1 (Q8_0/Q8_1); max -127 gives iscale 1 (Q8_K).
    ties = (rng.integers(-126, 126, n) + 0.5).astype(np.float32)
    t1 = ties.copy()
    t1[::32] = 127.0
    yield t1
    t2 = ties.copy()
    t2[::256] = -127.0
    yield t2
    t3 = ties.copy()
    t3[::256] = 127.0  # iscale -1
    yield t3
    t4 = ties.copy()
    t4[::32] = -127.0
    t4[1::32] = 127.0  # first occurrence of |max| decides the sign
    yield t4
    # blocks where some x*id lands on k + 0.5 after a non-trivial scale: amax 63.5 -> d = 0.5
    t5 = ((rng.integers(-60, 60, n) + 0.25) * 1.0).astype(np.float32)
    t5[::32] = 63.5
    yield t5


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("act", list(ACT_VIA))
def test_convert_bit_identical(level, act):
    rng = np.random.default_rng(7)
    wname = ACT_VIA[act]
    tid = WTYPES[wname][0]
    have_scalar = scalar_has(wname)
    sizes = [256, 512, 4096] if act == "Q8_K" else [32, 64, 256, 4096]
    if act in ("F16", "BF16"):
        sizes += [1, 7, 33, 1001]
    for n in sizes:
        for x in conversion_inputs(n, rng, act):
            got = _core.convert_activation(x, tid, level)
            np.testing.assert_array_equal(got, ref_convert(x, act), err_msg=f"{act} n={n} vs numpy model")
            if have_scalar:
                np.testing.assert_array_equal(got, _core.convert_activation(x, tid, "scalar"),
                                              err_msg=f"{act} n={n} vs scalar")


@pytest.mark.parametrize("level", LEVELS)
def test_convert_bf16_specials(level):
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 3.4e38, 1.00390625,
                  1.01171875, 65504.0, 1e-8] * 3, np.float32)
    x = np.concatenate([x, np.frombuffer(np.uint32([0x7FC00001, 0x7F800001, 0xFF812345]).tobytes(), np.float32)])
    got = _core.convert_activation(x, WTYPES["BF16"][0], level)
    np.testing.assert_array_equal(got, ref_convert(x, "BF16"))
    finite = x[np.isfinite(x)]
    got = _core.convert_activation(finite, WTYPES["F16"][0], level)
    np.testing.assert_array_equal(got, ref_convert(finite, "F16"))


# ---- matmul --------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(WTYPES))
def test_matmul_matches_scalar(level, name):
    if not scalar_has(name):
        pytest.skip("the scalar level has no kernel for this type yet")
    rng = np.random.default_rng(3)
    rows, cols, tokens = 67, 4096, 9  # 9 tokens: whole batch-kernel tiles and their edges
    tid = WTYPES[name][0]
    w = random_weights(name, cols, rng, rows)
    x = np.stack([activations(cols, rng) for _ in range(tokens)])
    got = _core.matmul(w, tid, x, level, 2)
    ref = _core.matmul(w, tid, x, "scalar", 1)
    # Per row: bound from the magnitude of the products (same activations after bit-identical conversion).
    wd = np.stack([dequant_weights(name, w[r]) for r in range(rows)])
    bound = 2e-5 * (np.abs(x).astype(np.float64) @ np.abs(wd).T) * 1.5 + 1e-5
    assert np.all(np.abs(got - ref) <= bound)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "MXFP4"])
@pytest.mark.parametrize("cols", [576, 640, 2048, 4096])
def test_matvec_rows_equal_their_vec_dot(level, name, cols):
    # One token goes through the multi-row kernel (short Q8_0 rows one at a time, others 8 at a
    # time, with a tail): every row must get exactly the bits of the level's own vec_dot.
    rng = np.random.default_rng(cols)
    rows = 67
    tid = WTYPES[name][0]
    w = random_weights(name, cols, rng, rows)
    x = activations(cols, rng)
    got = _core.matmul(w, tid, x[None], level, 2)[0]
    xq = _core.convert_activation(x, tid, level)
    want = np.array([_core.vec_dot_converted(tid, w[r], xq, cols, level) for r in range(rows)], np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
