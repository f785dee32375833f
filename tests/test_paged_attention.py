"""Decode attention over the paged host KV cache (optiml._core.PagedKV, the CPU side of issue #19's
attention offload).

Oracles: numpy in float64 over the same f16-rounded keys and values (the query and the softmax weights
rounded to f16 as the kernel rounds them), and the scalar kernel table against the SIMD ones.
"""

import numpy as np
import pytest

from optiml import _core

HD, N_HEAD, N_HEAD_KV, N_LAYER = 64, 8, 2, 3


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def reference(keys, values, q, scale):
    """keys/values: [n_seen][n_head_kv * HD] as stored; q: [N_HEAD * HD]."""
    k, v = f16(keys), f16(values)
    out = np.zeros(N_HEAD * HD)
    group = N_HEAD // N_HEAD_KV
    for h in range(N_HEAD):
        kvh = h // group
        qh = f16(q[h * HD:(h + 1) * HD])
        s = (k[:, kvh * HD:(kvh + 1) * HD] @ qh) * scale
        w = np.exp(s - s.max())
        w = f16(w / w.sum())
        out[h * HD:(h + 1) * HD] = w @ v[:, kvh * HD:(kvh + 1) * HD]
    return out


def fill(kv, rng, lengths, n_layer=N_LAYER):
    """Stores random keys and values: {seq: (keys [layer][n][width], values)}."""
    data = {}
    width = N_HEAD_KV * HD
    for seq, n in lengths.items():
        ks = rng.standard_normal((n_layer, n, width)).astype(np.float32)
        vs = rng.standard_normal((n_layer, n, width)).astype(np.float32)
        for p in range(n):
            for layer in range(n_layer):
                kv.store(layer, seq, p, ks[layer, p], vs[layer, p])
        data[seq] = (ks, vs)
    return data


LENGTHS = {0: 1, 1: 31, 2: 32, 5: 33, 7: 100}  # inside, at and across block edges; sparse sequence ids


@pytest.fixture(scope="module")
def filled():
    kv = _core.PagedKV(N_LAYER, N_HEAD_KV, HD, 64)
    data = fill(kv, np.random.default_rng(0), LENGTHS)
    return kv, data


def test_matches_float64_reference(filled):
    kv, data = filled
    rng = np.random.default_rng(1)
    seqs = np.array(list(LENGTHS), np.int32)
    scale = 1 / np.sqrt(HD)
    for layer in range(N_LAYER):
        for pos in (np.array([n - 1 for n in LENGTHS.values()], np.int32),  # each sequence's last position
                    np.array([0, 17, 31, 32, 64], np.int32)):               # earlier ones: causal cut
            q = rng.standard_normal((len(seqs), N_HEAD * HD)).astype(np.float32)
            got = kv.attend(layer, q, seqs, pos, scale)
            for t, (s, p) in enumerate(zip(seqs, pos)):
                ks, vs = data[int(s)]
                ref = reference(ks[layer, :p + 1], vs[layer, :p + 1], q[t], scale)
                np.testing.assert_allclose(got[t], ref, rtol=0, atol=2e-3)


@pytest.mark.parametrize("simd", [s for s in _core.simd_levels() if s != "scalar"])
def test_simd_matches_scalar(filled, simd):
    kv, _ = filled
    rng = np.random.default_rng(2)
    seqs = np.array(list(LENGTHS), np.int32)
    pos = np.array([n - 1 for n in LENGTHS.values()], np.int32)
    q = rng.standard_normal((len(seqs), N_HEAD * HD)).astype(np.float32)
    a = kv.attend(1, q, seqs, pos, 0.125, simd="scalar")
    b = kv.attend(1, q, seqs, pos, 0.125, simd=simd)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_blocks_are_reused_after_free():
    kv = _core.PagedKV(1, N_HEAD_KV, HD, 4)
    rng = np.random.default_rng(3)
    fill(kv, rng, {0: 64}, 1)  # two blocks
    assert kv.blocks_free == 2 and kv.length(0) == 64
    data = fill(kv, rng, {1: 64}, 1)  # the other two, full
    assert kv.blocks_free == 0
    with pytest.raises(_core.ArgumentError, match="blocks are in use"):
        kv.store(0, 1, 64, np.zeros(N_HEAD_KV * HD, np.float32), np.zeros(N_HEAD_KV * HD, np.float32))
    assert kv.length(1) == 64  # the refused store left the sequence as it was
    kv.free(0)
    assert kv.blocks_free == 2 and kv.length(0) == 0
    data.update(fill(kv, rng, {2: 50}, 1))  # takes sequence 0's old blocks: stale values must not leak in
    q = rng.standard_normal((2, N_HEAD * HD)).astype(np.float32)
    got = kv.attend(0, q, np.array([1, 2], np.int32), np.array([39, 49], np.int32), 0.125)
    for t, (s, p) in enumerate([(1, 39), (2, 49)]):
        ks, vs = data[s]
        np.testing.assert_allclose(got[t], reference(ks[0, :p + 1], vs[0, :p + 1], q[t], 0.125), atol=2e-3)


def test_bad_input_is_refused(filled):
    kv, _ = filled
    w = np.zeros(N_HEAD_KV * HD, np.float32)
    q = np.zeros((1, N_HEAD * HD), np.float32)
    cases = [
        (lambda: kv.store(0, 0, 5, w, w), "next to store is 1"),
        (lambda: kv.store(1, 7, 3, w, w), "layer 0 last stored 99"),
        (lambda: kv.store(3, 0, 1, w, w), "layer 3 of 3"),
        (lambda: kv.store(0, 0, 1, w[:5], w), "need 128 values"),
        (lambda: kv.attend(0, q, np.array([0], np.int32), np.array([1], np.int32), 1.0), "which holds 1"),
        (lambda: kv.attend(0, q, np.array([9], np.int32), np.array([0], np.int32), 1.0), "which holds 0"),
        (lambda: kv.attend(0, q[:, :100], np.array([0], np.int32), np.array([0], np.int32), 1.0), "whole heads"),
        (lambda: kv.attend(0, np.zeros((1, 3 * HD), np.float32), np.array([0], np.int32), np.array([0], np.int32), 1.0),
         "evenly"),
        (lambda: kv.attend(0, q, np.array([0, 1], np.int32), np.array([0], np.int32), 1.0), "positions"),
        (lambda: _core.PagedKV(1, 1, 63, 1), "odd"),
        (lambda: _core.PagedKV(0, 1, 64, 1), ">= 1"),
    ]
    for call, words in cases:
        with pytest.raises(_core.ArgumentError, match=words):
            call()
    assert kv.length(0) == 1  # nothing changed
