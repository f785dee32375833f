"""MXFP4 (ggml type 39, the experts of gpt-oss files) as a CPU weight type.

Oracles, none of them OptiML: gguf-py's MXFP4 decoder and quantizer (an independent numpy port of ggml's), a
float64 numpy model of the format (table value times 2^(e - 128)), float64 products of the dequantized weights
with the Q8_0-rounded activations, a float64 forward pass of the models (tests/test_moe.py's Reference), and
llama.cpp (llama-cpp-python) on the same files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import optiml
from optiml import _core, quant

sys.path.insert(0, str(Path(__file__).parent))
from fidelity import TIE, llama_cpp_greedy, load_llama_cpp, teacher_forced_greedy, top2_gap  # noqa: E402

# gguf-py's quantizer overflows float32 on the largest scales (|table value| * 2^127): the case being tested.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

gguf = pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")
from gguf import GGMLQuantizationType as GT  # noqa: E402

from test_moe import IDS, Reference, kld, llama_cpp_logits, synthetic  # noqa: E402

MXFP4 = 39
TABLE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float64)  # E2M1 doubled
LEVELS = _core.simd_levels()


def half_scale(e):
    """ggml's GGML_E8M0_TO_FP32_HALF in float64: 2^(e - 127) / 2, exact for every e (2^-128 .. 2^127)."""
    return np.ldexp(1.0, np.asarray(e, np.int64) - 128)


def f64_dequantize(blocks: np.ndarray) -> np.ndarray:
    """[n, 17] block bytes -> [n, 32] values in float64, from the format's definition."""
    codes = np.concatenate([blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4], axis=1)
    return TABLE[codes] * half_scale(blocks[:, :1])


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---- the format ----------------------------------------------------------------------------------------
def test_type_traits():
    t = quant.type_info("mxfp4")
    assert (t.id, t.name, t.block_size, t.type_size, t.vec_dot_type) == (MXFP4, "MXFP4", 32, 17, "Q8_0")
    assert (t.block_size, t.type_size) == gguf.GGML_QUANT_SIZES[GT.MXFP4]


def test_dequantize_every_scale_and_nibble():
    """Every E8M0 byte (0 and 1: denormal half-scales; 255: 2^127, not NaN, as ggml has it) with every nibble
    at every one of the 32 positions: block (e, k) holds code (k + j) % 16 at element j."""
    e = np.repeat(np.arange(256), 16)
    k = np.tile(np.arange(16), 256)
    codes = (k[:, None] + np.arange(32)[None, :]) % 16
    blocks = np.zeros((len(e), 17), np.uint8)
    blocks[:, 0] = e
    blocks[:, 1:] = codes[:, :16] | (codes[:, 16:] << 4)
    ours = quant.dequantize(blocks, "mxfp4")
    with np.errstate(over="ignore"):  # 2^127 times 2, 3, ... is beyond float32 in every decoder: inf
        theirs = gguf.quants.dequantize(blocks, GT.MXFP4)
        exact = f64_dequantize(blocks).astype(np.float32)
    assert same_bits(ours, theirs)
    assert same_bits(ours, exact)
    assert ours[16 * 0 + 0, 1] == np.float32(2.0 ** -128) and ours[16 * 255 + 0, 1] == np.float32(2.0 ** 127)
    assert np.isinf(ours[16 * 255 + 0, 2])


def quantize_cases(rng) -> dict[str, np.ndarray]:
    """Rows of 32-value blocks (float32) where ggml's rule has something to decide."""
    cases = {"normal": rng.standard_normal((8, 1024))}
    # Blocks of (almost) every magnitude the scale byte reaches, 2^-124 .. 2^123, and heavy tails.
    k = rng.integers(-124, 121, (16, 32, 1))
    cases["scales"] = (rng.standard_normal((16, 32, 32)) * np.ldexp(1.0, k)).reshape(16, 1024)
    cases["heavy"] = rng.standard_t(2, (4, 1024))
    cases["zeros"] = np.zeros((1, 64))
    cases["negative_zero"] = np.full((1, 32), -0.0)
    # amax exactly a power of two, and one float32 step under it (floor(log2) decides e there).
    p = np.ldexp(1.0, rng.integers(-100, 100, 64)).astype(np.float32)
    below = np.nextafter(p, np.float32(0))
    for name, top in (("power_of_two", p), ("just_below", below)):
        x = rng.uniform(-1, 1, (64, 32)) * top[:, None] * 0.9
        x[:, 5] = top * np.where(np.arange(64) % 2, 1, -1)
        cases[name] = x.reshape(2, 1024)
    # Ties between table values with d = 1 (amax in [8, 16)): x = 0.5, 1.5, 2.5, 3.5, 5, 7, 10 and their
    # negatives, -0.5 between 0 and -1 included; the first table entry wins, as ggml's strict < and numpy's
    # argmin have it; and values beyond 12 d (up to 16 d) that the table clips.
    ties = np.array([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0, 13.0, 14.0, 15.9, 12.0, 8.0, 0.25, 6.5, 11.0, 9.0])
    t = np.concatenate([ties, -ties])
    t[7] = 15.0  # amax 15: d = 2^(3 - 3) = 1
    cases["ties"] = np.stack([t, t * 2.0 ** -20, t * 2.0 ** 30, t[::-1]]).reshape(1, 128)
    cases["integers"] = rng.integers(-20, 20, (2, 256))
    return {name: np.asarray(v, np.float32) for name, v in cases.items()}


def test_quantize_matches_gguf_py_byte_for_byte():
    rng = np.random.default_rng(39)
    for name, x in quantize_cases(rng).items():
        ours = quant.quantize(x, "mxfp4")
        theirs = np.asarray(gguf.quants.quantize(x, GT.MXFP4)).view(np.uint8).reshape(ours.shape)
        assert np.array_equal(ours, theirs), f"{name}: blocks differ at {np.argwhere(ours != theirs)[:4].tolist()}"
        # and each value took the nearest table value at the block's scale (float64, the first on ties)
        blocks = ours.reshape(-1, 17)
        d = half_scale(blocks[:, :1])
        err = np.abs(f64_dequantize(blocks) - x.reshape(-1, 32).astype(np.float64))
        best = np.abs(TABLE[None, None, :] * d[:, :, None] - x.reshape(-1, 32, 1).astype(np.float64)).min(-1)
        assert np.all(err <= best * (1 + 2.0 ** -20) + 1e-300), name


def test_quantize_tiny_blocks_take_the_smallest_scale():
    """Blocks whose largest magnitude is under 2^-125 (ggml's exponent would be negative: an undefined cast
    there) get e = 0, half-scale 2^-128, and each value the nearest table value under it."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 32)) * np.array([2.0 ** -127, 2.0 ** -130, 1e-42, 2.0 ** -126])[:, None])
    x = x.astype(np.float32)
    q = quant.quantize(x, "mxfp4").reshape(-1, 17)
    assert (q[:, 0] == 0).all()
    err = np.abs(f64_dequantize(q) - x.astype(np.float64))
    assert np.all(err <= 2.0 ** -128 + 1e-300)


# ---- products ------------------------------------------------------------------------------------------
def random_rows(rng, rows, cols):
    """Random codes under E8M0 scales 2^-10 .. 2^-2 (weights of magnitude up to a few units)."""
    b = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    b[..., 0] = rng.integers(118, 126, (rows, cols // 32))
    return b.reshape(rows, -1)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("cols", [256, 4096])
def test_products_against_float64(level, cols):
    """vec_dot, the matrix-vector kernel (one token) and the batched kernel (several tokens) at each SIMD level:
    every (row, token) within float32 summation of the exact float64 product of the dequantized weights with
    the Q8_0-rounded activations, and bit for bit the level's own vec_dot; row counts off the kernels' 4-, 8- and
    16-row tiles, token counts off their 4- and 8-token tiles and over the 32-token switch."""
    rng = np.random.default_rng(cols)
    pool = random_rows(rng, 67, cols)
    wd = f64_dequantize(pool.reshape(-1, 17)).reshape(67, cols)
    for rows, n_tok in ((1, 1), (3, 2), (7, 3), (8, 1), (9, 5), (17, 9), (33, 4), (67, 33), (5, 67), (16, 1)):
        w = pool[:rows]
        x = (rng.standard_normal((n_tok, cols)) * rng.uniform(0.1, 3.0)).astype(np.float32)
        got = quant.matmul(w, "mxfp4", x, n_threads=2, simd=level)
        xq = np.stack([_core.convert_activation(x[t], MXFP4, level) for t in range(n_tok)])
        xd = quant.dequantize(xq, "q8_0").astype(np.float64)  # Q8_0 decodes exactly (gguf-py agrees)
        exact = xd @ wd[:rows].T
        bound = 2e-5 * (np.abs(xd) @ np.abs(wd[:rows]).T) + 1e-6
        assert np.all(np.abs(got - exact) <= bound), (level, rows, n_tok, np.abs(got - exact).max())
        dots = np.array([[_core.vec_dot_converted(MXFP4, w[r], xq[t], cols, level) for r in range(rows)]
                         for t in range(n_tok)], np.float32)
        assert same_bits(got, dots), (level, rows, n_tok)


def test_optiml_simd_picks_each_level(tmp_path):
    """OPTIML_SIMD=<level> in the environment: the default kernels are that level's (the same bits as asking
    for the level by name)."""
    rng = np.random.default_rng(1)
    w = random_rows(rng, 19, 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    code = ("import sys, numpy as np; from optiml import quant; w = np.load(sys.argv[1]); x = np.load(sys.argv[2]); "
            "sys.stdout.write(quant.matmul(w, 'mxfp4', x, n_threads=2).tobytes().hex())")
    d = tmp_path
    np.save(d / "w.npy", w)
    np.save(d / "x.npy", x)
    for level in LEVELS:
        env = {**os.environ, "OPTIML_SIMD": level}
        out = subprocess.run([sys.executable, "-c", code, str(d / "w.npy"), str(d / "x.npy")], env=env, check=True,
                             capture_output=True, text=True).stdout
        got = np.frombuffer(bytes.fromhex(out), np.float32).reshape(3, 19)
        assert same_bits(got, quant.matmul(w, "mxfp4", x, n_threads=2, simd=level)), level


def test_rows16_and_bad_lengths_refused():
    w = quant.quantize(np.ones((16, 64), np.float32), "mxfp4")
    with pytest.raises(optiml.ArgumentError, match="no rows16 layout"):
        quant.rows16(w, "mxfp4", 64)
    with pytest.raises(optiml.ArgumentError, match="multiple of 32"):
        quant.quantize(np.ones(48, np.float32), "mxfp4")


# ---- models against llama.cpp ----------------------------------------------------------------------------
class DenseReference(Reference):
    """test_moe's float64 forward pass with a dense SwiGLU FFN."""

    def moe(self, p, h):
        T = self.t
        g, u = h @ T[p + "ffn_gate.weight"].T, h @ T[p + "ffn_up.weight"].T
        return (g / (1 + np.exp(-g)) * u) @ T[p + "ffn_down.weight"].T


SHAPE = ["--n-embd", "256", "--n-layer", "2", "--n-head", "4", "--n-head-kv", "2", "--std", "0.1"]


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    """A llama whose attention and FFN matrices are all MXFP4 (embeddings and output Q8_0)."""
    return synthetic(tmp_path_factory.mktemp("mxfp4") / "llama-mxfp4.gguf", *SHAPE, "--n-ff", "512",
                     "--type", "mxfp4", "--output-type", "q8_0", "--seed", "3")


def check_against_llama_cpp(path, ref, label, n_greedy=24):
    """Our prompt logits and llama.cpp's against the float64 pass on the same file (ours within 10% of
    llama.cpp's KLD), ours against llama.cpp's, and llama.cpp's greedy continuation fed to both: wherever
    neither engine has a near-tie, the same argmax. Returns the KLDs."""
    with optiml.Model(path, n_ctx=256, n_threads=2) as m:
        ours = m.eval(IDS, all_logits=True)
        theirs = llama_cpp_logits(path, IDS)
        k_ours, k_theirs, k_pair = kld(ref, ours), kld(ref, theirs), kld(theirs, ours)
        print(f"{label}: KLD against float64 ours {k_ours:.3e}, llama.cpp {k_theirs:.3e}; "
              f"ours against llama.cpp {k_pair:.3e}")
        assert k_ours <= 1.1 * k_theirs + 1e-5, (label, k_ours, k_theirs)
        assert k_pair < 1e-5, (label, k_pair)  # measured 2e-14 .. 3e-9 (AVX2); a wrong code or scale: > 1e-3
        decided = (top2_gap(ours) > TIE) & (top2_gap(theirs) > TIE)
        assert decided.sum() >= len(IDS) // 3 and (ours.argmax(1) == theirs.argmax(1))[decided].all(), label
        llm = load_llama_cpp(path, 256)
        try:
            theirs_greedy, _ = llama_cpp_greedy(llm, IDS[:8], n_greedy)
            tf = teacher_forced_greedy(m, llm, IDS[:8], theirs_greedy)
        finally:
            llm.close()
        assert tf["disagree"] == [] and tf["decided"] >= n_greedy // 3, (label, tf)
    return k_ours, k_theirs, k_pair


def test_dense_llama_against_llama_cpp(dense_path):
    ref = DenseReference(dense_path).logits(IDS)
    check_against_llama_cpp(dense_path, ref, "dense llama, MXFP4 attention and FFN")


def test_dense_decode_steps_equal_the_batch(dense_path):
    """One token at a time (the matrix-vector kernel) gives the batch's logits (the batched kernel): the same
    per-(row, token) bits, so the same logits but for attention over a growing cache."""
    with optiml.Model(dense_path, n_ctx=64, n_threads=2) as m:
        batch = m.eval(IDS[:12], all_logits=True)
        m.reset()
        m.eval(IDS[:4])
        steps = np.stack([m.eval([t]) for t in IDS[4:12]])
    assert kld(batch[4:12], steps) < 1e-6
    assert (steps.argmax(1) == batch[4:12].argmax(1)).all()


def test_sparse_ffn_falls_back_to_the_8bit_down_copy(dense_path):
    """The activation-sparse token path over an MXFP4 FFN: gate and up rows through the matrix-vector kernel,
    down through its 8-bit neuron-major copy (the grouped lossless copy takes Q4_0/Q4_1/Q4_K only; compact
    falls back to it too): close to the batch path, as for the other types."""
    for copy in ("fast", "compact"):
        with optiml.Model(dense_path, n_ctx=64, n_threads=2, down_copy=copy) as m:
            m.set_sparsity("threshold", 0.05, criterion="gate")
            batch = m.eval(IDS[:16], all_logits=True)
            m.reset()
            steps = np.stack([m.eval([t]) for t in IDS[:16]])
            assert m.sparsity_stats()["skipped"] > 0.05
        rel = float(np.abs(steps - batch).max() / np.abs(batch).max())
        assert rel < 0.12, (copy, rel)


# (expert type, attention type, seed): seeds whose router has no near-tie in the float64 pass on IDS (a token
# whose k-th and (k+1)-th experts are within rounding of each other is a coin toss for any engine).
MOE_FILES = {"experts": ("mxfp4", "q8_0", 22), "all": ("mxfp4", "mxfp4", 8)}


def moe_file(tmp_path, which, seed):
    xtype, wtype, _ = MOE_FILES[which]
    return synthetic(tmp_path / f"q3-{which}-{seed}.gguf", *SHAPE, "--router-std", "0.3", "--arch", "qwen3moe",
                     "--n-ff", "512", "--experts", "16", "--experts-used", "4", "--n-ff-exp", "256",
                     "--type", wtype, "--expert-type", xtype, "--output-type", "q8_0", "--seed", str(seed))


@pytest.mark.parametrize("which", list(MOE_FILES))
def test_moe_against_llama_cpp(tmp_path, which):
    """qwen3moe with 16 MXFP4 experts (4 used) per layer, beside Q8_0 attention (gpt-oss's mix) or MXFP4
    attention too: both engines against the float64 pass, and against each other."""
    seed = MOE_FILES[which][2]
    path = moe_file(tmp_path, which, seed)
    r = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.ffn_down_exps.weight"] == "MXFP4" and types["blk.1.ffn_gate_exps.weight"] == "MXFP4"
    oracle = Reference(path)
    ref = oracle.logits(IDS)
    assert oracle.route_gap > 0.02, f"the router has a near-tie (margin {oracle.route_gap:.4f}): pick another seed"
    check_against_llama_cpp(path, ref, f"qwen3moe, MXFP4 experts ({which})")
    # One token at a time: each chosen expert's product through the matrix-vector kernel.
    with optiml.Model(path, n_ctx=64, n_threads=2) as m:
        m.eval(IDS[:4])
        steps = np.stack([m.eval([t]) for t in IDS[4:16]])
    assert kld(ref[4:16], steps) <= 1.1 * kld(ref[4:16], llama_cpp_logits(path, IDS[:16])[4:16]) + 1e-5


@pytest.mark.skipif(not optiml.system_info()["cuda_devices"], reason="no CUDA device (and not the emulator build)")
def test_mxfp4_on_cuda_matches_the_cpu(tmp_path):
    """CUDA decodes MXFP4 blocks for its float products (dequant.cuh): MXFP4 experts whole on the GPU, and an
    MXFP4 output matrix, against the CPU run of the same file (a prompt, then decode steps)."""
    def both(path, **kw):
        out = []
        for device in ("cpu", "cuda"):
            with optiml.Model(path, n_ctx=64, n_threads=2, device=device, **kw) as m:
                out.append(np.vstack([m.eval(IDS[:20], all_logits=True)] + [m.eval([t]) for t in IDS[20:23]]))
        return out
    ref, got = both(moe_file(tmp_path, "experts", 22))
    assert kld(ref, got) < 1e-4
    dense = synthetic(tmp_path / "out-mxfp4.gguf", *SHAPE, "--n-ff", "512", "--type", "q8_0", "--output-type", "mxfp4")
    ref, got = both(dense)
    assert kld(ref, got) < 1e-4
