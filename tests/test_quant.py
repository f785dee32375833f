"""Block formats: our quantize/dequantize/dot against gguf-py (an independent implementation) and numpy."""

import numpy as np
import pytest

# gguf-py warns when huge test values overflow fp16 scales; that is the case being tested.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

import gguf
from gguf import GGMLQuantizationType as GT

import optiml
from optiml import _core
from optiml import quant

ALL_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
             "Q6_K"]
GGUF_QUANTIZE_TYPES = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

# Byte offsets of the fp16 scale fields in each block (d, m / dmin), from ggml_types.h.
SCALE_OFFSETS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def gguf_dequantize(data: np.ndarray, name: str) -> np.ndarray:
    return gguf.quants.dequantize(data, GT[name]).astype(np.float32)


def assert_same_floats(a: np.ndarray, b: np.ndarray):
    """Bitwise equality, except that any NaN equals any NaN."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    assert a.shape == b.shape
    na, nb = np.isnan(a), np.isnan(b)
    assert np.array_equal(na, nb), "NaN positions differ"
    bad = (a.view(np.uint32) != b.view(np.uint32)) & ~na
    assert not bad.any(), f"{bad.sum()} values differ, first at {np.argwhere(bad)[0]}: {a[bad][0]!r} vs {b[bad][0]!r}"


def block_size(name):
    return quant.type_info(name).block_size


def sample(rng, rows, cols, kind="normal"):
    if kind == "normal":
        x = rng.standard_normal((rows, cols))
    elif kind == "uniform":
        x = rng.uniform(-1, 1, (rows, cols))
    elif kind == "heavy":
        x = rng.standard_t(3, (rows, cols))
    elif kind == "scaled":  # blocks of very different magnitudes, positive-biased ones too
        x = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-6, 4, (rows, cols // 32, 1)).repeat(32, -1).reshape(rows, cols)
        x += rng.uniform(0, 1, (rows, 1)) * np.abs(x).mean()
    return x.astype(np.float32)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---- type table and API --------------------------------------------------------------------


def test_type_info_accepts_names_ids_and_enums():
    for name in ALL_TYPES:
        gt = GT[name]
        a, b, c = quant.type_info(name.lower()), quant.type_info(int(gt)), quant.type_info(gt)
        assert a == b == c
        assert a.name == name and a.id == int(gt)
        assert (a.block_size, a.type_size) == gguf.GGML_QUANT_SIZES[gt]
    assert quant.type_info("q4_k").vec_dot_type == "Q8_K"
    assert quant.type_info("q4_1").vec_dot_type == "Q8_1"


# ---- dequantize == gguf-py ------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_TYPES)
@pytest.mark.parametrize("kind", ["normal", "scaled"])
def test_dequantize_quantized_data_matches_gguf(name, kind, rng):
    x = sample(rng, 8, 1024, kind)
    data = quant.quantize(x, name)
    assert data.dtype == np.uint8 and data.shape == (8, 1024 // block_size(name) * quant.type_info(name).type_size)
    assert_same_floats(quant.dequantize(data, name), gguf_dequantize(data, name))


def random_blocks(rng, name, n_blocks):
    """Random block bytes with sane (finite, varied, sometimes zero or subnormal) fp16 scales."""
    ti = quant.type_info(name)
    if name == "F32":
        return (rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-30, 30, n_blocks)).astype(np.float32).view(np.uint8)
    raw = rng.integers(0, 256, (n_blocks, ti.type_size), dtype=np.uint8)
    if name in ("F16", "BF16"):
        return raw.reshape(-1)  # every bit pattern, NaN and inf included (compared NaN-safely)
    for off in SCALE_OFFSETS.get(name, []):  # (MXFP4's E8M0 scale byte: every value, 255's infinities too)
        s = rng.uniform(-1, 1, n_blocks) * 10.0 ** rng.uniform(-7, 2, n_blocks)
        s[::17] = 0.0
        raw[:, off:off + 2] = s.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantize_random_bytes_matches_gguf(name, rng):
    data = random_blocks(rng, name, 4096 if quant.type_info(name).block_size > 1 else 1 << 16)
    ours = quant.dequantize(data, name)
    assert_same_floats(ours, gguf_dequantize(data, name))


def test_dequantize_shapes_and_n(rng):
    x = rng.standard_normal((2, 3, 256)).astype(np.float32)
    q = quant.quantize(x, "q4_k")
    assert q.shape == (2, 3, 144)
    y = quant.dequantize(q, "Q4_K", n=256)
    assert y.shape == (2, 3, 256) and y.dtype == np.float32
    assert_same_floats(y, quant.dequantize(bytes(q.tobytes()), "q4_k").reshape(2, 3, 256))
    assert_same_floats(quant.dequantize(quant.quantize(x, "f32"), "f32"), x)


def test_large_arrays_use_threads_consistently(rng):
    """Arrays above the threading threshold split over blocks; the result must not depend on it."""
    x = sample(rng, 64, 4096, "normal")
    q = quant.quantize(x, "q4_k")
    for r in (0, 31, 63):
        assert np.array_equal(q[r], quant.quantize(x[r], "q4_k"))
    assert_same_floats(quant.dequantize(q, "q4_k")[5], quant.dequantize(q[5], "q4_k"))


# ---- quantize == gguf-py ------------------------------------------------------------------


def edge_cases(rng):
    cases = {
        "normal": rng.standard_normal((4, 512)),
        "scaled": sample(rng, 4, 512, "scaled"),
        "zeros": np.zeros((2, 256)),
        "constant": np.repeat(rng.standard_normal((2, 8, 1)), 32, axis=2).reshape(2, 256),
        "positive": rng.uniform(0.5, 2.0, (2, 256)),
        "huge": rng.standard_normal((2, 256)) * 1e30,
        "beyond_fp16": rng.standard_normal((2, 256)) * 1e5,
        "tiny": rng.standard_normal((2, 256)) * 1e-30,
        "fp16_subnormal_scales": rng.standard_normal((2, 256)) * 1e-6,
        "integers": rng.integers(-20, 20, (2, 256)),
    }
    # Exact .5 ties after scaling: a block whose extreme gives d = 1 (Q8_0: amax 127; Q4_0: max -8,
    # Q5_0: max -16; Q4_1/Q5_1: min 0 and max 15/31), the other values k + 0.5.
    halves = rng.integers(-7, 7, (4, 32)) + 0.5
    t8 = halves.copy(); t8[:, 0] = 127.0
    t4 = halves.copy(); t4[:, 0] = -8.0
    t5 = halves.copy(); t5[:, 0] = -16.0
    t41 = np.abs(halves); t41[:, 0] = 0.0; t41[:, 1] = 15.0
    t51 = np.abs(halves); t51[:, 0] = 0.0; t51[:, 1] = 31.0
    cases["ties"] = np.concatenate([t8, t4, t5, t41, t51], axis=1)
    # fp16 rounding ties for F16/BF16 conversion
    cases["fp16_ties"] = (np.arange(1, 257, dtype=np.float32) * (1 + 2.0 ** -11)).reshape(1, 256) * (-1) ** np.arange(256)
    return {k: np.asarray(v, dtype=np.float32) for k, v in cases.items()}


@pytest.mark.parametrize("name", GGUF_QUANTIZE_TYPES)
def test_quantize_matches_gguf(name, rng):
    for case, x in edge_cases(rng).items():
        ours = quant.quantize(x, name)
        ref = np.asarray(gguf.quants.quantize(x, GT[name])).view(np.uint8).reshape(ours.shape)
        assert np.array_equal(ours, ref), f"{name} {case}: {np.argwhere(ours != ref)[:4].tolist()}"


def test_quantize_f32_and_nan_f16_bf16():
    x = np.array([[np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 65520.0, 1e-8, 3.0e38]], np.float32)
    assert np.array_equal(quant.quantize(x, "f32").view(np.float32), x, equal_nan=True)
    for name in ("F16", "BF16"):
        ours = quant.quantize(x, name)
        ref = np.asarray(gguf.quants.quantize(x, GT[name])).view(np.uint8).reshape(ours.shape)
        assert np.array_equal(ours, ref), name


# ---- k-quant round trips -----------------------------------------------------------------------


def ref_fp16(v):
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float32)


def reference_kquant_rmse(x: np.ndarray, name: str) -> float:
    """RMSE of a straightforward search in the format's structure, as a bar our quantizer must clear.

    Q4_K/Q5_K: per 32-weight sub-block, scale = (max - min)/nmax with min clipped to <= 0; scales and
    mins as 6-bit multiples of fp16 super-block factors. Q6_K: per 16-weight sub-block, symmetric
    scale = (signed extreme)/-32 (levels -32..31), as signed 8-bit multiples of an fp16 super-scale.
    """
    blocks = x.reshape(-1, 256).astype(np.float32)
    if name in ("Q4_K", "Q5_K"):
        nmax = 15 if name == "Q4_K" else 31
        sb = blocks.reshape(-1, 8, 32)
        mn = np.minimum(sb.min(-1), 0)
        mx = sb.max(-1)
        scale = (mx - mn) / nmax
        minv = -mn
        d = ref_fp16(scale.max(-1, keepdims=True) / 63)
        dm = ref_fp16(minv.max(-1, keepdims=True) / 63)
        with np.errstate(divide="ignore", invalid="ignore"):
            ls = np.where(d > 0, np.clip(np.round(scale / d), 0, 63), 0)
            lm = np.where(dm > 0, np.clip(np.round(minv / dm), 0, 63), 0)
            sc, mm = d * ls, dm * lm
            q = np.where(sc[..., None] > 0, np.clip(np.round((sb + mm[..., None]) / sc[..., None]), 0, nmax), 0)
        y = sc[..., None] * q - mm[..., None]
    else:  # Q6_K
        sb = blocks.reshape(-1, 16, 16)
        i = np.abs(sb).argmax(-1)[..., None]
        scale = np.take_along_axis(sb, i, -1)[..., 0] / -32  # signed: the extreme lands on level -32
        j = np.abs(scale).argmax(-1)[..., None]
        d = ref_fp16(np.take_along_axis(scale, j, -1) / -128)
        with np.errstate(divide="ignore", invalid="ignore"):
            ls = np.where(d != 0, np.clip(np.round(scale / d), -128, 127), 0)
            sc = d * ls
            q = np.where(sc[..., None] != 0, np.clip(np.round(sb / sc[..., None]), -32, 31), 0)
        y = sc[..., None] * q
    return float(np.sqrt(np.mean((y.reshape(x.shape) - x) ** 2)))


KQUANT_RMSE = {}  # filled by the test, printed with -s


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("kind", ["normal", "uniform", "heavy"])
def test_kquant_error_no_worse_than_reference_search(name, kind, rng):
    x = sample(rng, 16, 4096, kind)
    data = quant.quantize(x, name)
    y = gguf_dequantize(data, name)  # read back by gguf-py: our layout is llama.cpp's
    ours = float(np.sqrt(np.mean((y - x) ** 2)))
    ref = reference_kquant_rmse(x, name)
    KQUANT_RMSE[(name, kind)] = (ours, ref)
    print(f"{name} {kind}: rmse {ours:.5f} (reference search {ref:.5f}, std {x.std():.3f})")
    assert ours <= ref


@pytest.mark.parametrize("name,bound", [("Q2_K", 0.40), ("Q3_K", 0.22), ("Q4_K", 0.09), ("Q5_K", 0.045), ("Q6_K", 0.022)])
def test_kquant_round_trip_error_bounds(name, bound, rng):
    x = sample(rng, 16, 2048, "normal")
    data = quant.quantize(x, name)
    y = gguf_dequantize(data, name)
    rmse = float(np.sqrt(np.mean((y - x) ** 2)))
    print(f"{name} normal(0,1): rmse {rmse:.5f}")
    assert rmse < bound
    assert_same_floats(quant.dequantize(data, name), y)
    # Zero blocks stay exactly zero.
    z = quant.dequantize(quant.quantize(np.zeros((1, 512), np.float32), name), name)
    assert np.array_equal(z, np.zeros_like(z))


# ---- activation conversion contract ---------------------------------------------------------


def ref_q8_0(x):
    """Q8_0 activations as llama.cpp's x86 runtime converts them: id = 127/amax, ties to even."""
    b = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(b).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qs = np.rint((b * inv[:, None]).astype(np.float32)).astype(np.int8)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), qs.view(np.uint8)], axis=1).reshape(-1)


def ref_q8_1(x):
    b = x.reshape(-1, 32).astype(np.float32)
    q8 = ref_q8_0(x).reshape(-1, 34)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    qs = q8[:, 2:].view(np.int8)
    s = (d * qs.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float32).astype(np.float16)
    return np.concatenate([q8[:, :2], s.view(np.uint8).reshape(-1, 2), q8[:, 2:]], axis=1).reshape(-1)


def ref_q8_k(x):
    b = x.reshape(-1, 256).astype(np.float32)
    out = []
    for blk in b:
        i = int(np.argmax(np.abs(blk)))
        mx = blk[i]
        if mx == 0:
            out.append(np.zeros(292, np.uint8))
            continue
        iscale = np.float32(-127.0) / mx
        q = np.minimum(np.rint(iscale * blk), 127).astype(np.int8)
        d = np.float32(1.0) / iscale
        bs = q.astype(np.int16).reshape(16, 16).sum(-1).astype(np.int16)
        out.append(np.concatenate([np.array([d], np.float32).view(np.uint8), q.view(np.uint8), bs.view(np.uint8)]))
    return np.concatenate(out)


def activation_values(xq: np.ndarray, xtype: str, n: int) -> np.ndarray:
    """Float64 values of a converted activation row (independent numpy decoding)."""
    if xtype == "F32":
        return xq.view(np.float32).astype(np.float64)
    if xtype == "F16":
        return xq.view(np.float16).astype(np.float64)
    if xtype == "BF16":
        return (xq.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if xtype == "Q8_0":
        b = xq.reshape(-1, 34)
        return (b[:, :2].copy().view(np.float16).astype(np.float64) * b[:, 2:].view(np.int8)).reshape(-1)
    if xtype == "Q8_1":
        b = xq.reshape(-1, 36)
        return (b[:, :2].copy().view(np.float16).astype(np.float64) * b[:, 4:].view(np.int8)).reshape(-1)
    b = xq.reshape(-1, 292)
    return (b[:, :4].copy().view(np.float32).astype(np.float64) * b[:, 4:260].view(np.int8)).reshape(-1)


def activation_halfstep(xq: np.ndarray, xtype: str, x: np.ndarray) -> np.ndarray:
    """Per element, the largest error the conversion may make: half a quantization step (or 1 ulp)."""
    if xtype == "F32":
        return np.zeros(x.size)
    if xtype in ("F16", "BF16"):
        bits = 11 if xtype == "F16" else 8
        return np.abs(x.astype(np.float64)) * 2.0 ** -bits + (6e-8 if xtype == "F16" else 0)
    if xtype == "Q8_0":
        d = xq.reshape(-1, 34)[:, :2].copy().view(np.float16).astype(np.float64)
        return np.repeat(d[:, 0], 32) * 0.5 * 1.001 + np.abs(x) * 2.0 ** -10  # d is stored as fp16
    if xtype == "Q8_1":
        d = xq.reshape(-1, 36)[:, :2].copy().view(np.float16).astype(np.float64)
        return np.repeat(d[:, 0], 32) * 0.5 * 1.001 + np.abs(x) * 2.0 ** -10
    d = xq.reshape(-1, 292)[:, :4].copy().view(np.float32).astype(np.float64)
    return np.repeat(np.abs(d[:, 0]), 256) * 0.5 * 1.001


@pytest.mark.parametrize("wname", ALL_TYPES)
def test_activation_conversion_is_bit_exact(wname, rng):
    xtype = quant.type_info(wname).vec_dot_type
    cases = [sample(rng, 1, 1024, "normal")[0], sample(rng, 1, 1024, "scaled")[0], np.zeros(1024, np.float32)]
    ties = np.zeros(1024, np.float32)
    ties[:] = rng.integers(-60, 60, 1024) + 0.5
    ties[::256] = 127.0  # Q8_K: iscale = -1 -> q = rint(-x), ties to even
    ties[::32] = 127.0  # Q8_0/Q8_1: id = 1 -> q = rint(x), ties to even
    cases.append(ties)
    for x in cases:
        for simd in _core.simd_levels():
            xq = _core.convert_activation(x, quant.type_id(wname), simd)
            if xtype == "Q8_0":
                ref = ref_q8_0(x)
            elif xtype == "Q8_1":
                ref = ref_q8_1(x)
            elif xtype == "Q8_K":
                ref = ref_q8_k(x)
            else:
                ref = quant.quantize(x, xtype).reshape(-1)
                gref = np.asarray(gguf.quants.quantize(x, GT[xtype])).view(np.uint8).reshape(-1)
                assert np.array_equal(ref, gref)
            assert np.array_equal(xq, ref), f"{wname} ({xtype}) at {simd}"


# ---- dot products -----------------------------------------------------------------------------


def q8_1_min_correction(w_row: np.ndarray, xq: np.ndarray, xtype: str) -> float:
    """Q4_1/Q5_1 dots use the stored fp16 s = fp16(d_x * sum(q_x)) for the min term (as llama.cpp
    does), not d_x * sum(q_x) itself; returns sum over blocks of m_w * (s - d_x * sum(q_x))."""
    if xtype != "Q8_1":
        return 0.0
    xb = xq.reshape(-1, 36)
    d = xb[:, 0:2].copy().view(np.float16).astype(np.float64)[:, 0]
    s = xb[:, 2:4].copy().view(np.float16).astype(np.float64)[:, 0]
    qsum = xb[:, 4:].view(np.int8).astype(np.int64).sum(-1)
    wb = w_row.reshape(xb.shape[0], -1)
    m = wb[:, 2:4].copy().view(np.float16).astype(np.float64)[:, 0]
    return float(np.sum(m * (s - d * qsum)))


@pytest.mark.parametrize("wname", ALL_TYPES)
@pytest.mark.parametrize("kind", ["normal", "scaled"])
def test_dot_matches_float64_reference(wname, kind, rng):
    n = 2048
    xtype = quant.type_info(wname).vec_dot_type
    tid = quant.type_id(wname)
    W = sample(rng, 6, n, kind)
    wq = quant.quantize(W, wname)
    wd = gguf_dequantize(wq, wname).astype(np.float64)
    for r in range(W.shape[0]):
        x = sample(rng, 1, n, kind)[0]
        xq = _core.convert_activation(x, tid, "scalar")
        xv = activation_values(xq, xtype, n)
        got = quant.dot(wq[r], wname, x, simd="scalar")
        # 1) Same as the float64 dot of the dequantized weight with the dequantized activation, up to
        #    float32 accumulation of per-block partial sums.
        corr = q8_1_min_correction(wq[r], xq, xtype)
        exact = float(wd[r] @ xv) + corr
        mag = float(np.abs(wd[r]) @ np.abs(xv))
        assert abs(got - exact) <= 2e-6 * mag + 1e-30, (got, exact, mag)
        # 2) Close to the dot with the original activations: each activation moved by at most half a step.
        ref = float(wd[r] @ x.astype(np.float64))
        tol = float(np.abs(wd[r]) @ activation_halfstep(xq, xtype, x)) + abs(corr) + 2e-6 * mag + 1e-30
        assert abs(got - ref) <= tol, (got, ref, tol)
        # Every SIMD level agrees with the scalar reference up to float summation order.
        for simd in _core.simd_levels():
            other = quant.dot(wq[r], wname, x, simd=simd)
            assert abs(other - got) <= 1e-5 * mag + 1e-30, (simd, other, got)


@pytest.mark.parametrize("wname", ["F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_matmul_equals_rowwise_dot(wname, rng):
    n, rows = 512, 37
    W = quant.quantize(sample(rng, rows, n), wname)
    X = sample(rng, 3, n)
    Y = quant.matmul(W, wname, X, simd="scalar")
    assert Y.shape == (3, rows)
    for t in range(3):
        expect = np.array([quant.dot(W[r], wname, X[t], simd="scalar") for r in range(rows)], np.float32)
        assert np.array_equal(Y[t], expect)
    y1 = quant.matmul(W, wname, X[1], n_threads=2, simd="scalar")
    assert y1.shape == (rows,) and np.array_equal(y1, Y[1])


# ---- bad arguments ----------------------------------------------------------------------------


def test_bad_arguments_raise_argument_error(rng):
    x = rng.standard_normal((2, 64)).astype(np.float32)
    q = quant.quantize(x, "q4_0")
    with pytest.raises(optiml.ArgumentError, match="multiple of 32"):
        quant.quantize(rng.standard_normal(33).astype(np.float32), "q4_0")
    with pytest.raises(optiml.ArgumentError, match="multiple of 256"):
        quant.quantize(x, "q4_k")
    with pytest.raises(optiml.ArgumentError):
        quant.quantize(x, "q9_9")
    with pytest.raises(optiml.ArgumentError):
        quant.quantize(x, 4)  # a gap in ggml's numbering
    with pytest.raises(optiml.ArgumentError):
        quant.quantize(x, 1000)
    with pytest.raises(optiml.ArgumentError):
        quant.quantize(x, 2.0)
    with pytest.raises(optiml.ArgumentError, match="not supported"):
        quant.quantize(rng.standard_normal(256).astype(np.float32), "iq2_xxs")
    with pytest.raises(optiml.ArgumentError):
        quant.quantize(np.array(["a"] * 32), "q8_0")
    with pytest.raises(optiml.ArgumentError):
        quant.quantize(x.astype(np.complex64), "q8_0")
    with pytest.raises(optiml.ArgumentError, match="uint8"):
        quant.dequantize(q.astype(np.float32), "q4_0")
    with pytest.raises(optiml.ArgumentError, match="whole number"):
        quant.dequantize(q[:, :-1], "q4_0")
    with pytest.raises(optiml.ArgumentError, match="bytes"):
        quant.dequantize(q, "q4_0", n=32)
    with pytest.raises(optiml.ArgumentError, match="multiple"):
        quant.dequantize(q, "q4_0", n=48)
    with pytest.raises(optiml.ArgumentError):
        quant.dequantize(q, "iq2_xxs")  # (a type this library has no code for)
    with pytest.raises(optiml.ArgumentError):
        quant.dot(q[0][:-2], "q4_0", x[0])
    with pytest.raises(optiml.ArgumentError):
        quant.dot(q[0], "q4_0", x[0][:32])
    with pytest.raises(optiml.ArgumentError):
        quant.dot(q[0], "q4_0", x[0], simd="nosuchlevel")
    with pytest.raises(optiml.ArgumentError):
        quant.matmul(q, "q4_0", x[:, :32])
    assert issubclass(optiml.ArgumentError, ValueError)


# ---- the real model ---------------------------------------------------------------------------


def test_smollm2_tensors_dequantize_like_gguf(smollm2_path):
    reader = gguf.GGUFReader(str(smollm2_path))  # gguf-py's reader, independent of ours
    seen = set()
    for t in reader.tensors:
        qt = GT(int(t.tensor_type))
        seen.add(qt.name)
        raw = np.asarray(t.data)
        ref = gguf.quants.dequantize(raw, qt).astype(np.float32).reshape(-1)
        ours = quant.dequantize(raw.view(np.uint8), int(qt)).reshape(-1)
        assert ours.size == int(np.prod(t.shape)), t.name
        assert_same_floats(ours, ref)
    assert "Q4_1" in seen


@pytest.mark.parametrize("name, tid", [("IQ4_NL", 20), ("IQ4_XS", 23)])
def test_iq4_quantization_is_llama_cpps(name, tid, rng):
    """IQ4_NL and IQ4_XS as llama-quantize writes them without an importance matrix: ggml's own
    ggml_quantize_chunk (llama-cpp-python's libggml-base, called live) on the same rows, normal and heavy-tailed
    weights, a row of zeros and one of tiny values among them. Block for block the same bytes (a compiler that
    fuses ggml's multiply-adds may round a near-tie of the scale search the other way: at most 1% of rows),
    and the same error."""
    import ctypes
    import glob
    import os

    from conftest import llama_cpp_module

    lib = glob.glob(os.path.join(os.path.dirname(llama_cpp_module().__file__), "lib", "libggml-base.so*"))
    if not lib:
        pytest.skip("llama-cpp-python has no libggml-base here")
    ggml = ctypes.CDLL(lib[0])
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    x = np.concatenate([rng.standard_normal((96, 1024)), rng.standard_t(3, (96, 1024)) * 0.02,
                        np.zeros((1, 1024)), rng.standard_normal((1, 1024)) * 1e-20]).astype(np.float32)
    ours = quant.quantize(x, name)
    theirs = np.zeros_like(ours)
    ggml.ggml_quantize_chunk(tid, x.ctypes.data, theirs.ctypes.data, 0, x.shape[0], x.shape[1], None)
    same = (ours == theirs).all(axis=1)
    assert same.mean() >= 0.99, np.flatnonzero(~same)[:8]
    assert same[-2:].all()  # zeros and tiny values
    err = [np.sqrt(((quant.dequantize(q, name, x.shape[1]) - x) ** 2).mean()) for q in (ours, theirs)]
    assert err[0] == pytest.approx(err[1], rel=1e-3) and err[0] < 0.1
