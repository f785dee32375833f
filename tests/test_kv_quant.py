"""A quantized KV cache (issue #47): keys and values stored as q8_0 or q4_0 (llama.cpp's cache types), read
by the CPU attention in decode, prompt and batched steps, in the NEO offload path and across prefix copies.

Oracles: llama-cpp-python's own quantized cache (flash attention, which llama.cpp needs for a quantized V)
on the same file and the same tokens: the KL divergence that our q8_0/q4_0 cache costs against our f16
cache may be at most 10% above what llama.cpp's costs against its f16 cache (numpy float64 log-softmax);
the plan's byte counts against the block formats' sizes (34 bytes per 32 values for q8_0, 18 for q4_0);
and the f16 cache's own bit-exact equalities (a sequence alone or in a batch, copied or not, on the device
or offloaded) holding for the quantized cache too (a sequence alone or in a batch: tests/test_engine.py's
test_batch_equals_alone, over every cache type).
"""

import numpy as np
import pytest

import optiml
from conftest import check_prefix_copy_and_truncate, shared_eval_text
from optiml import ArgumentError

WINDOW, N_WINDOWS = 256, 2


def _log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kld(ref, other):
    """Mean KL(ref || other) over the rows, in float64."""
    a, b = _log_softmax(ref), _log_softmax(other)
    return float((np.exp(a) * (a - b)).sum(-1).mean())


@pytest.fixture(scope="module")
def windows(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=64, n_threads=2) as m:
        ids = m.tokenize(shared_eval_text())
    assert len(ids) >= WINDOW * N_WINDOWS
    return [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(N_WINDOWS)]


def _optiml_logits(path, windows, kv):
    with optiml.Model(path, n_ctx=WINDOW, n_threads=2, kv_type=kv) as m:
        out = []
        for w in windows:
            m.reset()
            out.append(m.eval(w, all_logits=True))
        return np.vstack(out)


def _llama_logits(path, windows, kv):
    llama_cpp = pytest.importorskip("llama_cpp")
    t = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}[kv]
    llm = llama_cpp.Llama(str(path), n_ctx=WINDOW, n_batch=WINDOW, n_threads=2, logits_all=True, type_k=t,
                          type_v=t, flash_attn=True, verbose=False)
    try:
        out = []
        for w in windows:
            llm.reset()
            llm.eval(w)
            out.append(np.array(llm.scores[:len(w)]))
        return np.vstack(out)
    finally:
        llm.close()


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_kld_against_the_f16_cache_matches_llama_cpp(smollm2_path, windows, kv):
    ours = _kld(_optiml_logits(smollm2_path, windows, "f16"), _optiml_logits(smollm2_path, windows, kv))
    theirs = _kld(_llama_logits(smollm2_path, windows, "f16"), _llama_logits(smollm2_path, windows, kv))
    print(f"{kv}: KLD vs f16 optiml {ours:.5f}, llama.cpp {theirs:.5f} ({ours / theirs:.2f}x)")
    assert 0 < ours <= 1.10 * theirs


def test_the_plan_halves_and_quarters_the_cache(smollm2_path):
    hp = optiml.Model(smollm2_path, n_ctx=64, n_threads=2).hparams
    n_kv = hp["head_dim"] * hp["n_head_kv"]
    n_ctx, n_seq = 256, 2
    per_value = {"f16": 2.0, "f32": 4.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # the block formats' bytes
    host = {}
    for k in per_value:
        for v in per_value:
            p = optiml.plan.make(smollm2_path, n_ctx=n_ctx, n_seq=n_seq, device="cpu", kv_type_k=k, kv_type_v=v)
            assert (p.kv_type_k, p.kv_type_v) == (k, v)
            host[k, v] = p.host_kv_bytes
            assert p.host_kv_bytes == hp["n_layer"] * n_seq * n_ctx * n_kv * (per_value[k] + per_value[v])
            assert f"keys {k}, values {v}" in str(p)
    assert host["q8_0", "q8_0"] / host["f16", "f16"] == 17 / 32  # half, and a scale per 32 values
    assert host["q4_0", "q4_0"] / host["f16", "f16"] == 9 / 32   # a quarter, and a scale per 32 values
    # On a device the plan's KV bytes shrink alike, and the engine allocates what the plan counts.
    for kv in ("f16", "q8_0", "q4_0"):
        with optiml.Model(smollm2_path, n_ctx=n_ctx, n_threads=2, n_seq=n_seq, device="cpu:1", vram="2GiB",
                          kv_type=kv) as m:
            assert m.plan.device_bytes["kv"] == host[kv, kv]
            assert sum(m._session.device_allocations.values()) == m.plan.device_bytes["total"]
            assert m._session.kv_bytes == host[kv, kv]


PROMPTS = ["The capital of France is", "Once upon a time, there", "def fibonacci(n):", "Water boils at"]


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_prefix_copy_and_truncate(smollm2_path, kv):
    """conftest.check_prefix_copy_and_truncate on the CPU's quantized cache."""
    with optiml.Model(smollm2_path, n_ctx=64, n_threads=2, n_seq=3, kv_type=kv) as m:
        check_prefix_copy_and_truncate(m, m.tokenize(PROMPTS[1]))


def test_offloaded_sequences_give_the_same_logits(smollm2_path):
    """NEO offload with a q8_0 cache: sequences moved to host memory (the KVCache::place copies of their
    rows) and back give the logits they get on the device, bit for bit."""
    def run(moves):
        with optiml.Model(smollm2_path, n_ctx=64, n_threads=2, n_seq=2, device="cpu:1", vram="2GiB",
                          kv_type="q8_0", kv_type_v="q4_0") as m:
            ids = [m.tokenize(p) for p in PROMPTS[:2]]
            for s, where in moves.get(0, []):
                m.kv_place(s, where)
            b = optiml.Batch()
            for s, p in enumerate(ids):
                b.add_sequence(p, seq=s, logits="last")
            out = [m.decode(b)]
            pos = [len(p) for p in ids]
            for k in range(1, 4):
                for s, where in moves.get(k, []):
                    m.kv_place(s, where)
                nxt = [int(r.argmax()) for r in out[-1]]
                b = optiml.Batch()
                for s in range(2):
                    b.add(nxt[s], s, pos[s], logits=True)
                    pos[s] += 1
                out.append(m.decode(b))
            return np.vstack(out)

    ref = run({})
    np.testing.assert_array_equal(run({0: [(1, "host")]}), ref)
    np.testing.assert_array_equal(run({1: [(0, "host")], 2: [(0, "device"), (1, "host")]}), ref)


def test_cache_type_names(smollm2_path):
    """llama.cpp's names in any case, and ggml's type ids (llama_cpp.GGML_TYPE_*) as aliases; anything else
    refused with the list of what works."""
    for given, want in [("Q8_0", "q8_0"), (8, "q8_0"), (2, "q4_0"), ("fp16", "f16"), (0, "f32")]:
        assert optiml.plan.make(smollm2_path, n_ctx=32, device="cpu", kv_type=given).kv_type_k == want
    p = optiml.plan.make(smollm2_path, n_ctx=32, device="cpu", kv_type="q4_0", kv_type_k="q8_0")
    assert (p.kv_type_k, p.kv_type_v) == ("q8_0", "q4_0")
    for bad in [dict(kv_type="q5_1"), dict(kv_type_v="bf16"), dict(kv_type_k=3), dict(kv_type=True)]:
        with pytest.raises(ArgumentError, match=r"f16, f32, q8_0, q4_0"):
            optiml.Model(smollm2_path, n_ctx=32, n_threads=2, **bad)
    # the native layer refuses on its own too
    with pytest.raises(ArgumentError, match="'f16', 'f32', 'q8_0' or 'q4_0'"):
        optiml._core.make_plan(optiml._core.Model(str(smollm2_path).encode()), 32, kv_type="iq4_nl")


# ---- the paged host cache (optiml._core.PagedKV) with quantized keys and values --------------------------
HD, N_HEAD, N_HEAD_KV = 64, 8, 2
GGML_TYPE = {"f16": 1, "q8_0": 8, "q4_0": 2}


def _hadamard(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def _f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def _dequantized(x, kind):
    """x [..., 32k] quantized to q8_0 (llama.cpp's x86 rounding: 127/amax, ties to even) or q4_0 (its
    reference: the signed extreme maps to -8) and back, in float64 (scales rounded to f16 as stored)."""
    b = np.asarray(x, np.float32).reshape(-1, 32).astype(np.float64)
    if kind == "q8_0":
        amax = np.abs(b).max(1, keepdims=True)
        d = amax / 127
        q = np.round(b * np.where(amax > 0, np.float32(127) / amax.astype(np.float32), 0))
    else:
        ext = np.take_along_axis(b, np.abs(b).argmax(1)[:, None], 1)
        d = ext / -8
        q = np.minimum(15, np.trunc(b * np.where(d != 0, 1 / d, 0) + 8.5)) - 8
    return (q * _f16(d)).reshape(np.shape(x))


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")])
def test_paged_cache_matches_float64(kt, vt):
    """Attention over a PagedKV of quantized blocks against numpy in float64 over the same blocks: keys and
    query rotated by the 64-wide Walsh-Hadamard matrix, keys quantized, the query in q8_0; values rotated,
    quantized, weighed in float and the output rotated back (f16 sides as the f16 cache rounds them)."""
    from optiml import _core

    rng = np.random.default_rng(7)
    kv = _core.PagedKV(1, N_HEAD_KV, HD, 8, GGML_TYPE[kt], GGML_TYPE[vt])
    assert kv.bytes == 8 * 32 * N_HEAD_KV * HD * sum({"f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}[t] for t in (kt, vt))
    lengths = {0: 45, 3: 100}
    data = {}
    for seq, n in lengths.items():
        ks = rng.standard_normal((n, N_HEAD_KV * HD)).astype(np.float32)
        vs = rng.standard_normal((n, N_HEAD_KV * HD)).astype(np.float32)
        ks[:, 5] *= 20  # an outlier dimension, as real keys have: what the rotation is for
        for p in range(n):
            kv.store(0, seq, p, ks[p], vs[p])
        data[seq] = (ks, vs)
    H = _hadamard(HD)
    seqs, pos = np.array([0, 3, 3], np.int32), np.array([44, 99, 40], np.int32)
    q = rng.standard_normal((3, N_HEAD * HD)).astype(np.float32)
    got = kv.attend(0, q, seqs, pos, 0.125)
    for t in range(3):
        ks, vs = data[int(seqs[t])]
        n = pos[t] + 1
        for h in range(N_HEAD):
            kvh = h // (N_HEAD // N_HEAD_KV)
            k, v = ks[:n, kvh * HD:(kvh + 1) * HD], vs[:n, kvh * HD:(kvh + 1) * HD]
            qh = q[t, h * HD:(h + 1) * HD]
            if kt == "f16":
                s = _f16(k) @ _f16(qh)
            else:
                s = _dequantized(k.astype(np.float64) @ H, kt) @ _dequantized(qh.astype(np.float64) @ H, "q8_0")
            w = np.exp(0.125 * s - (0.125 * s).max())
            w /= w.sum()
            ref = _f16(w) @ _f16(v) if vt == "f16" else (w @ _dequantized(v.astype(np.float64) @ H, vt)) @ H
            np.testing.assert_allclose(got[t, h * HD:(h + 1) * HD], ref, rtol=0, atol=2e-3)
    with pytest.raises(_core.ArgumentError, match="f16, q8_0 or q4_0"):
        _core.PagedKV(1, N_HEAD_KV, HD, 8, 6)
