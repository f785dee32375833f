"""IQ4_NL and IQ4_XS, the non-linear 4-bit formats of llama.cpp's quantizer (read here, not written): blocks
dequantized as gguf-py does, dot products against float64 references of the dequantized operands on every SIMD
level, and SmolLM2 requantized by llama.cpp (llama-cpp-python's llama_model_quantize) run against llama.cpp
itself."""

import ctypes

import gguf
import numpy as np
import pytest

import optiml
from optiml import _core, quant

from conftest import llama_cpp_module

TYPES = ["IQ4_NL", "IQ4_XS"]


def random_blocks(rng, name, n_blocks):
    """Random codes and six-bit scales, with finite fp16 super-block scales d (the first two bytes)."""
    ti = quant.type_info(name)
    raw = rng.integers(0, 256, (n_blocks, ti.type_size), dtype=np.uint8)
    d = rng.uniform(-1, 1, n_blocks) * 10.0 ** rng.uniform(-4, 0, n_blocks)
    raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_matches_gguf(name):
    rng = np.random.default_rng(7)
    data = random_blocks(rng, name, 512).reshape(-1)
    ours = quant.dequantize(data, name)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name]).astype(np.float32)
    assert np.array_equal(ours.view(np.uint32), want.view(np.uint32))
    assert _core.can_quantize(quant.type_id(name))  # (written as ggml writes them: tests/test_quant.py)


@pytest.mark.parametrize("name", TYPES)
def test_dot_matches_float64_and_every_level_agrees(name):
    """The dot of a row with an activation (converted to Q8_0 / Q8_K as the kernels convert it): the float64
    dot of the two dequantized, up to float32 summation; every SIMD level within summation order of the
    scalar kernel; a batch's tokens the same as each alone."""
    rng = np.random.default_rng(11)
    n, rows = 1024, 5
    ti = quant.type_info(name)
    W = random_blocks(rng, name, rows * n // ti.block_size).reshape(rows, -1)
    Wd = quant.dequantize(W.reshape(-1), name).astype(np.float64).reshape(rows, n)
    tid, xtype = quant.type_id(name), ti.vec_dot_type
    X = rng.standard_normal((9, n)).astype(np.float32)  # (whole tiles of the batched kernels and edges)
    for x in X[:3]:
        xq = _core.convert_activation(x, tid, "scalar")
        xv = quant.dequantize(np.frombuffer(xq, np.uint8) if not isinstance(xq, np.ndarray) else xq, xtype).astype(np.float64)
        for r in range(rows):
            got = quant.dot(W[r], name, x, simd="scalar")
            mag = float(np.abs(Wd[r]) @ np.abs(xv))
            assert abs(got - float(Wd[r] @ xv)) <= 2e-6 * mag + 1e-30
            for simd in _core.simd_levels():
                assert abs(quant.dot(W[r], name, x, simd=simd) - got) <= 1e-5 * mag + 1e-30, simd
    for simd in _core.simd_levels():
        for tokens in (X[:3], X):  # (up to 4 tokens: the panels of row pairs; more: whole tiles and edges)
            batch = quant.matmul(W, name, tokens, simd=simd)
            alone = np.vstack([quant.matmul(W, name, tokens[t:t + 1], simd=simd) for t in range(len(tokens))])
            assert np.array_equal(batch, alone), (simd, len(tokens))


@pytest.fixture(scope="module")
def requantized(smollm2_path, tmp_path_factory):
    """SmolLM2 requantized by llama.cpp to IQ4_XS: its rows of 576 values, not a multiple of 256, llama.cpp
    writes as IQ4_NL, so the file holds both formats (the FFN's down matrices IQ4_XS, the rest IQ4_NL)."""
    llama_cpp = llama_cpp_module()
    path = tmp_path_factory.mktemp("iq4") / "smollm2-iq4_xs.gguf"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS, True, 2
    assert llama_cpp.llama_model_quantize(str(smollm2_path).encode(), str(path).encode(), ctypes.byref(p)) == 0
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"IQ4_NL", "IQ4_XS"} <= types, types
    return path


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_smollm2_runs_as_llama_cpp_runs_it(requantized):
    """256 tokens of real text through both engines: the distributions agree (mean KL divergence) and the
    top token mostly does. The bound is the noise of this 135M model's 4-bit weights under 8-bit activations:
    between our own SIMD levels its logits differ by about 6e-3 in KL; a wrong scale or table is far above."""
    llama_cpp = llama_cpp_module()
    path = requantized
    text = open(__file__.replace("test_iq4.py", "data/scandal-in-bohemia.txt"), encoding="utf-8").read()[:3000]
    with optiml.Model(path, n_ctx=512, n_threads=2) as m:
        ids = m.tokenize(text)[:256]
        ours = m.eval(ids, all_logits=True)
        m.reset()  # decode steps too (the one-token kernels)
        steps = np.vstack([m.eval(ids[:200], all_logits=True)] + [m.eval([t])[None] for t in ids[200:208]])
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    try:
        llm.eval(ids)
        ref = np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()
    p = log_softmax(ref)
    for got in (ours, steps):
        q = log_softmax(got)
        kld = float((np.exp(p[:len(q)]) * (p[:len(q)] - q)).sum(-1).mean())
        assert kld < 0.015, kld
        assert (ref[:len(got)].argmax(-1) == got.argmax(-1)).mean() >= 0.85
