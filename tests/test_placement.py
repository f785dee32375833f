"""Writing a placement into the GGUF (optiml.formats.placement, optiml.formats.gguf_edit) and showing it (optiml info).

A placed file computes what its source computes, for every down type, and llama.cpp runs it to the same
greedy text. SmolLM2's Q4_1 down cannot move a neuron's column across quant blocks, so with a neuron-level
order its weights stay as they are and optiml.placement.neuron_order records the order: the logits are
bit for bit the source's. Where the order moves whole blocks (a crafted order here), or down is a float
type (a tiny converted model), the weights are permuted in the file, exactly in their own type: the
logits then differ from the source's only by float summation order.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct

import numpy as np
import pytest

import optiml
import optiml.cli
from optiml import gguf, quant
from optiml.formats import stats as S
from optiml._core import ArgumentError, GGUFError
from optiml.formats.gguf_edit import GGUFValueType, read_kv_spans, rewrite_gguf
from optiml.formats import placement as P
from optiml.formats.placement import coverage_curve, curve_ranks, read_placement, write_placed

from conftest import llama_cpp_module

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]
N_GEN = 24
TIE_GAP = 0.05  # llama.cpp steps whose top two logits are closer than this may go either way
# ... and for a file permuted in a quantized type, where 8-bit activation rounding lifts float-order
# differences to rounding level (see test_block_order_permutes_q4_1_exactly)
ROUNDING_TIE = 0.3


@dataclasses.dataclass
class Placement:  # the fields of optiml.offline.solve.Placement
    gpu_neurons: list
    group: int
    vram_budget: int
    vram_used: int
    fixed_bytes: int
    ctx: int
    hardware: dict
    est_token_s: float
    method: str
    status: str
    gap: float
    solve_s: float
    coverage: list


def _shape(path):
    with gguf.open(path) as f:
        arch = f.metadata["general.architecture"]
        return int(f.metadata[f"{arch}.block_count"]), int(f.metadata[f"{arch}.feed_forward_length"])


def _stats(path, freq, seed=0) -> S.ActivationStats:
    L, F = freq.shape
    rng = np.random.default_rng(seed)
    mean_abs = rng.uniform(0.01, 1, (L, F)).astype(np.float32)
    down_norm = rng.uniform(0.5, 1.5, (L, F)).astype(np.float32)
    B = 8
    z = np.zeros((L, B))
    return S.ActivationStats(
        fingerprint=S.model_fingerprint(path), model=os.path.basename(path), activation="silu", n_tokens=12345,
        sources="synthetic-a.txt\nsynthetic-b.txt", threshold=np.zeros(L, np.float32), freq=freq.astype(np.float32),
        mean_abs=mean_abs, mean_abs_up=np.ones_like(mean_abs), down_norm=down_norm, impact=mean_abs * down_norm,
        hist_edges=np.r_[0, np.geomspace(1e-3, 10, B - 1), np.inf].astype(np.float32),
        gate_hist=z, gate_err=z, prod_hist=z, prod_err=z)


def synth_stats(path, seed=0) -> S.ActivationStats:
    """Power-law firing frequencies over a random neuron order per layer (a neuron-level order)."""
    L, F = _shape(path)
    rng = np.random.default_rng(seed)
    freq = np.empty((L, F), np.float32)
    for l in range(L):
        alpha = 0.4 + 0.6 * l / L
        freq[l] = np.minimum(1.0, 0.9 * (rng.permutation(F) + 1.0) ** -alpha + rng.uniform(0, 1e-3, F))
    return _stats(path, freq, seed)


def block_stats(path, block, seed=1) -> S.ActivationStats:
    """Frequencies whose hot-first order moves whole blocks of `block` neurons (blocks in a random order,
    neurons shuffled inside each block)."""
    L, F = _shape(path)
    rng = np.random.default_rng(seed)
    nb = F // block
    freq = np.empty((L, F), np.float32)
    for l in range(L):
        rank = np.repeat(rng.permutation(nb), block)  # block b's rank
        freq[l] = (nb - rank + rng.uniform(0, 0.5, F)) / (nb + 1)
    return _stats(path, freq, seed)


def synth_placement(st: S.ActivationStats, group=64) -> Placement:
    L, F = st.freq.shape
    k = [int(min(F, group * round((0.1 + 0.6 * l / L) * F / group))) for l in range(L)]
    k[0] = 0  # an all-CPU layer
    cov = coverage_curve(st.freq)
    return Placement(k, group, 2**30, 123456789, 1000000, 1024, {"gpu": "synthetic", "gpu_bw": 1.5e12}, 0.0123,
                     "mip", "Optimal", 0.001, 0.5, [float(cov[l, kk - 1]) if kk else 0.0 for l, kk in enumerate(k)])


def _greedy_seq(m, ids, n=N_GEN):
    m.reset()
    lg = m.eval(ids)
    out = list(ids)
    for _ in range(n):
        t = int(lg.argmax())
        out.append(t)
        lg = m.eval([t])
    m.reset()
    return out


def _logits(path, ids):
    with optiml.Model(path, n_ctx=256, n_threads=2) as m:
        return m.eval(ids, all_logits=True)


def _rel(a, b):
    """max |a - b| over each position's logit spread (max - min), the largest over positions."""
    return float((np.abs(a - b).max(1) / (a.max(1) - a.min(1))).max())


def llama_cpp_run(path, prompt, n=N_GEN, seq=None):
    """(llama.cpp's greedy ids after `prompt`, its logits [T, V] for the sequence) on the file; with
    seq given, the logits of seq instead (teacher forcing)."""
    llama_cpp = llama_cpp_module()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False,
                          n_threads=1, n_threads_batch=1)  # 2 spinning threads crawl on a busy 2-core machine
    try:
        if seq is None:
            llm.eval(llm.tokenize(prompt.encode(), add_bos=True, special=True))
            for _ in range(n):
                llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
            seq = [int(t) for t in llm.eval_tokens]
        else:
            llm.eval(seq)
        return seq, np.array(llm.scores[: len(seq)], dtype=np.float32)
    finally:
        llm.close()


def llama_cpp_same_greedy(src, placed, prompts=PROMPTS, tie=TIE_GAP):
    """llama.cpp's greedy continuation on the source, scored by llama.cpp on both files: the same token
    wins at every step where the source's top two are at least `tie` apart. Returns the largest
    logit difference over the spread."""
    worst = 0.0
    for prompt in prompts:
        seq, _ = llama_cpp_run(src, prompt)
        # Both files scored the same way, on the whole sequence at once: llama.cpp's batch and one-token
        # kernels differ by more than rounding ties on some CPUs (AVX-512).
        _, a = llama_cpp_run(src, prompt, seq=seq)
        _, b = llama_cpp_run(placed, prompt, seq=seq)
        n_prompt = len(seq) - N_GEN
        a, b = a[n_prompt - 1:-1], b[n_prompt - 1:-1]
        want = [int(t) for t in a.argmax(1)]
        top2 = np.sort(a, axis=1)[:, -2:]
        bad = [i for i in range(N_GEN) if int(b[i].argmax()) != want[i] and top2[i, 1] - top2[i, 0] >= tie]
        assert bad == [], (prompt, bad)
        worst = max(worst, _rel(a, b))
    return worst


@pytest.fixture(scope="module")
def work(tmp_path_factory, smollm2_path):
    """SmolLM2 Q4_1 placed with a neuron-level order (its weights kept, neuron_order recorded), shared
    by the tests of this module."""
    d = tmp_path_factory.mktemp("placement")
    st = synth_stats(smollm2_path)
    pl = synth_placement(st)
    out = d / "placed.gguf"
    res = write_placed(smollm2_path, st, pl, out, progress=False)
    assert res == {"form": "neuron_order", "down_types": {"Q4_1": 30}}
    return {"dir": d, "stats": st, "placement": pl, "placed": out, "src": smollm2_path}


# ---- (a) the placed file computes what the source computes ------------------------------------
def test_neuron_order_file_is_exact(work):
    """Quantized down, neuron-level order: the weights are the source's bytes, the logits its bits, and
    llama.cpp's greedy tokens its own."""
    with optiml.Model(work["src"], n_ctx=256) as m:
        ids = _greedy_seq(m, m.tokenize(PROMPTS[0]))
    np.testing.assert_array_equal(_logits(work["placed"], ids), _logits(work["src"], ids))
    for prompt in PROMPTS:
        assert llama_cpp_run(work["placed"], prompt)[0] == llama_cpp_run(work["src"], prompt)[0]


def test_block_order_permutes_q4_1_exactly(work, tmp_path):
    """An order that moves whole Q4_1 blocks (neurons shuffled inside them) permutes the file in Q4_1:
    down's values are the source's columns exactly. The logits are not the source's bits: the down
    products add their blocks in another order, and the 8-bit rounding of every later matmul input turns
    those last-bit differences into rounding-level ones. llama.cpp shows the same on this file
    (measured over both prompts: at most 0.038 of the logit spread here, 0.044 in llama.cpp; greedy
    flips only where the source's top two were within 0.13; llama.cpp against OptiML on the source
    itself differs by 0.030)."""
    src = work["src"]
    st = block_stats(src, 32)
    out = tmp_path / "blocks.gguf"
    assert write_placed(src, st, synth_placement(st), out, progress=False)["form"] == "permuted"
    assert "neuron_order" not in read_placement(out)
    order = S.hot_first_order(st.freq, st.impact)
    with gguf.open(src) as f0, gguf.open(out) as f1:
        for l in (0, 17, 29):
            name = f"blk.{l}.ffn_down.weight"
            assert f1.tensor(name).type_name == "Q4_1"
            np.testing.assert_array_equal(f1.dequantize(name), f0.dequantize(name)[:, order[l]])
            for k in ("ffn_gate.weight", "ffn_up.weight"):
                np.testing.assert_array_equal(f1.tensor_data(f"blk.{l}.{k}"), f0.tensor_data(f"blk.{l}.{k}")[order[l]])
    with optiml.Model(src, n_ctx=256) as m:
        ids = _greedy_seq(m, m.tokenize(PROMPTS[0]))
    a, b = _logits(src, ids), _logits(out, ids)
    assert _rel(a, b) < 0.08, _rel(a, b)
    top2 = np.sort(a, axis=1)[:, -2:]
    assert ((a.argmax(1) == b.argmax(1)) | (top2[:, 1] - top2[:, 0] < ROUNDING_TIE)).all()
    assert llama_cpp_same_greedy(src, out, tie=ROUNDING_TIE) < 0.08
    out.unlink()


@pytest.mark.parametrize("qtype", ["f32", "f16", "bf16", "q8_0", "q5_1", "q4_k_m"])
def test_every_down_type_is_exact(qtype, tmp_path, tiny_hf):
    """A tiny converted model (n_ff 160) per output type. Float down: permuted column by column; a block
    type: permuted block by block under a block order, kept with neuron_order under a neuron order.
    Either way the engine's logits are the source's (bit for bit when kept, to float summation order
    when permuted) and llama.cpp's greedy tokens are the source's."""
    from optiml.convert import convert

    src = convert(tiny_hf, tmp_path / "src.gguf", type=qtype)
    with gguf.open(src) as f:
        down = f.tensor("blk.0.ffn_down.weight")
        block = quant.type_info(down.type).block_size
    floating = down.type_name in ("F32", "F16", "BF16")
    ids = list(np.random.default_rng(3).integers(0, 290, 40))
    a = _logits(src, ids)
    cases = [("neuron", synth_stats(src), "permuted" if floating else "neuron_order")]
    if not floating and 160 % block == 0:
        cases.append(("block", block_stats(src, block), "permuted"))
    for what, st, form in cases:
        out = tmp_path / f"{what}.gguf"
        assert write_placed(src, st, synth_placement(st, group=32), out, progress=False)["form"] == form, what
        b = _logits(out, ids)
        if form == "neuron_order":
            np.testing.assert_array_equal(a, b)
        else:
            assert _rel(a, b) < 1e-4, (what, _rel(a, b))  # measured <= 8.4e-6
            order = S.hot_first_order(st.freq, st.impact)
            with gguf.open(src) as f0, gguf.open(out) as f1:
                for l in range(3):
                    for k in ("ffn_gate.weight", "ffn_up.weight", "ffn_gate.bias", "ffn_up.bias"):
                        x0, x1 = f0.dequantize(f"blk.{l}.{k}"), f1.dequantize(f"blk.{l}.{k}")
                        np.testing.assert_array_equal(x1, x0[order[l]] if x0.ndim == 2 else x0[..., order[l]])
                    n = f"blk.{l}.ffn_down.weight"
                    np.testing.assert_array_equal(f1.dequantize(n), f0.dequantize(n)[:, order[l]])
                    np.testing.assert_array_equal(f1.dequantize(f"blk.{l}.ffn_down.bias"),
                                                  f0.dequantize(f"blk.{l}.ffn_down.bias"))
        llama_cpp_same_greedy(src, out, prompts=["The capital of France is"])


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_convert import make_model, save_folder, tiny_bpe

    d = tmp_path_factory.mktemp("tiny")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_bpe(), eos_token="<|endoftext|>").save_pretrained(
        d / "tok")
    model = make_model("llama-mqa-bias")
    del torch
    return save_folder(model, d / "hf", d / "tok")


# ---- (b) moving codes inside quant blocks -------------------------------------------------------
@pytest.mark.parametrize("name", sorted(P._CODE_LAYOUT))
def test_block_moves_match_gguf_py(name):
    """Blocks moved and their elements reordered by code equal gguf-py's dequantization of the source,
    permuted (an independent decoder)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gdeq
    from gguf.quants import quantize as gq

    rng = np.random.default_rng(7)
    n_ff, rows = 256, 6
    x = rng.normal(size=(rows, n_ff)).astype(np.float32)
    gtype = T[name]
    info = quant.type_info(name)
    if name == "IQ4_NL":  # no quantizer at hand: any codes under a finite f16 scale are a valid block
        data = rng.integers(0, 256, (rows, n_ff // 32, info.type_size), dtype=np.uint8)
        data[..., :2] = rng.uniform(0.01, 1, (rows, n_ff // 32, 1)).astype(np.float16).view(np.uint8)
        data = data.reshape(rows, -1)
    else:
        data = gq(x, gtype)
    nb = n_ff // 32
    order = (rng.permutation(nb)[:, None] * 32 + np.array([rng.permutation(32) for _ in range(nb)])).reshape(-1)
    assert P.down_permutable(name, 32, order)

    class T0:  # what a transform receives
        type, type_name, shape = info.id, name, (n_ff, rows)

    out, _, _ = P._permute_down(order)(T0, np.ascontiguousarray(data))
    np.testing.assert_array_equal(gdeq(out, gtype), gdeq(data, gtype)[:, order])
    # a neuron-level order cannot move in this type; an order that moves whole blocks always can
    assert not P.down_permutable(name, 32, rng.permutation(n_ff))


def test_k_quants_move_whole_blocks_only():
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gdeq

    rng = np.random.default_rng(8)
    x = rng.normal(size=(4, 768)).astype(np.float32)
    data = quant.quantize(x, "q4_k")
    blocks = rng.permutation(3)
    order = (blocks[:, None] * 256 + np.arange(256)).reshape(-1)
    assert P.down_permutable("Q4_K", 256, order)
    info = quant.type_info("q4_k")

    class T0:
        type, type_name, shape = info.id, "Q4_K", (768, 4)

    out, _, _ = P._permute_down(order)(T0, data)
    np.testing.assert_array_equal(gdeq(out, T.Q4_K), gdeq(data, T.Q4_K)[:, order])
    shuffled = order.copy()
    shuffled[:2] = shuffled[1::-1]  # two neurons swapped inside a block: sub-block scales forbid it
    assert not P.down_permutable("Q4_K", 256, shuffled)


# ---- (c) bytes and metadata --------------------------------------------------------------------
def test_neuron_order_file_keeps_every_tensor(work):
    order = S.hot_first_order(work["stats"].freq, work["stats"].impact)
    with gguf.open(work["src"]) as f0, gguf.open(work["placed"]) as f1:
        assert [t.name for t in f0.tensors] == [t.name for t in f1.tensors]
        assert f1.alignment == f0.alignment
        for t0, t1 in zip(f0.tensors, f1.tensors):
            assert t1.type == t0.type and t1.shape == t0.shape
            assert np.array_equal(f0.tensor_data(t0.name), f1.tensor_data(t1.name)), t0.name
        assert f1.metadata_types["optiml.placement.neuron_order"] == "array[int32]"
    d = read_placement(work["placed"])
    assert d["form"] == "neuron_order" and d["neuron_order"].shape == (30, 1536)
    np.testing.assert_array_equal(d["neuron_order"], order)


def test_metadata_round_trip(work):
    st, pl = work["stats"], work["placement"]
    d = read_placement(work["placed"])
    assert d["version"] == 2 and d["group_size"] == pl.group
    assert d["gpu_neurons"] == pl.gpu_neurons
    np.testing.assert_allclose(d["coverage"], pl.coverage, rtol=1e-6)
    for k in ("vram_budget", "vram_used", "fixed_bytes", "ctx"):
        assert d[k] == getattr(pl, k)
    assert d["hardware"] == pl.hardware
    assert d["solver"] == {"method": "mip", "status": "Optimal", "gap": 0.001, "solve_s": 0.5}
    assert d["est_token_ms"] == pytest.approx(12.3, rel=1e-6)
    assert "down_type" not in d
    assert d["stats.tokens"] == 12345 and d["stats.sources"] == st.sources
    assert d["stats.fingerprint"] == st.fingerprint
    ranks = np.asarray(d["curve_ranks"])
    assert ranks[0] == 1 and ranks[-1] == st.n_ff and 100 <= len(ranks) <= 160 and (np.diff(ranks) > 0).all()
    np.testing.assert_array_equal(ranks, curve_ranks(st.n_ff))
    np.testing.assert_allclose(d["curve_freq"], -np.sort(-st.freq, axis=1)[:, ranks - 1], rtol=1e-6)
    np.testing.assert_allclose(d["curve_coverage"][:, -1], 1.0, rtol=1e-5)
    with gguf.open(work["src"]) as f0, gguf.open(work["placed"]) as f1:
        md1 = {k: v for k, v in f1.metadata.items() if not k.startswith("optiml.placement.")}
        assert list(md1) == list(f0.metadata)  # same keys, same order
        assert {k: f1.metadata_types[k] for k in md1} == f0.metadata_types
        for k, v in f0.metadata.items():
            assert np.array_equal(np.asarray(md1[k]), np.asarray(v)), k
        assert f1.metadata_types["optiml.placement.gpu_neurons"] == "array[int32]"
        assert f1.metadata_types["optiml.placement.vram_budget"] == "uint64"
    assert read_placement(work["src"]) is None


def test_replaces_placement_and_keeps_sparsity(work):
    d = work["dir"]
    src2 = d / "with-meta.gguf"
    rewrite_gguf(work["src"], src2, progress=False, set_kv={
        "optiml.sparsity.threshold": (np.linspace(0, 1, 30, dtype=np.float32), GGUFValueType.ARRAY),
        "optiml.placement.version": (1, GGUFValueType.UINT32),
        "optiml.placement.down_type": ("q8_0", None),
        "optiml.placement.stale": ("old", None)})
    out = d / "replaced.gguf"
    write_placed(src2, work["stats"], work["placement"], out, progress=False)
    with gguf.open(out) as f:
        np.testing.assert_array_equal(f.metadata["optiml.sparsity.threshold"], np.linspace(0, 1, 30, dtype=np.float32))
        assert f.metadata["optiml.placement.version"] == 2
        assert "optiml.placement.stale" not in f.metadata and "optiml.placement.down_type" not in f.metadata
    src2.unlink()
    out.unlink()


def test_bad_neuron_order_is_refused(work, tmp_path):
    order = read_placement(work["placed"])["neuron_order"].copy()
    order[3, 7] = order[3, 8]  # a neuron twice, another never
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(work["placed"], bad, progress=False,
                 set_kv={"optiml.placement.neuron_order": (order.reshape(-1), GGUFValueType.ARRAY)})
    with pytest.raises(GGUFError, match="neuron_order of layer 3 is not a permutation"):
        read_placement(bad)
    rewrite_gguf(work["placed"], bad, progress=False,
                 set_kv={"optiml.placement.neuron_order": (order.reshape(-1)[:-5], GGUFValueType.ARRAY)})
    with pytest.raises(GGUFError, match="30 layers x n_ff"):
        read_placement(bad)


# ---- (d) errors ---------------------------------------------------------------------------------
def test_errors(work, tmp_path, capsys):
    st, pl, src = work["stats"], work["placement"], work["src"]
    other = dataclasses.replace(st, fingerprint="0" * 32, model="another-model.gguf")
    with pytest.raises(ArgumentError, match="measured on"):
        write_placed(src, other, pl, tmp_path / "x.gguf", progress=False)
    with pytest.raises(ArgumentError, match="is the input"):
        write_placed(src, st, pl, src, progress=False)
    with pytest.raises(ArgumentError, match="does not exist"):
        write_placed(src, st, pl, tmp_path / "missing" / "x.gguf", progress=False)
    with pytest.raises(ArgumentError, match="layers"):
        write_placed(src, st, dataclasses.replace(pl, gpu_neurons=pl.gpu_neurons[:-1]), tmp_path / "x.gguf",
                     progress=False)
    with pytest.raises(ArgumentError, match="not within"):
        write_placed(src, st, dataclasses.replace(pl, gpu_neurons=[5000] * 30), tmp_path / "x.gguf", progress=False)
    # a file that keeps its order is placed from the original (the same stats fit both)
    with pytest.raises(ArgumentError, match="place the original file"):
        write_placed(work["placed"], st, pl, tmp_path / "x.gguf", progress=False)
    saved = work["dir"] / "stats.npz"  # optiml solve says so before it solves
    S.save(st, saved)
    assert optiml.cli.main(["-q", "solve", "-m", str(work["placed"]), "--stats", str(saved), "--vram", "10MiB",
                     "--hardware", "auto", "--predictors", "none", "-o", str(tmp_path / "x.gguf")]) == 2
    assert "place the original file" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []

    # a failing transform mid-file: nothing left behind, an existing output untouched
    (tmp_path / "keep.gguf").write_bytes(b"old")

    def boom(t, data):
        raise RuntimeError("transform failed")

    with pytest.raises(RuntimeError, match="transform failed"):
        rewrite_gguf(src, tmp_path / "keep.gguf", transforms={"blk.20.ffn_up.weight": boom}, progress=False)
    with pytest.raises(ArgumentError, match="bytes"):
        rewrite_gguf(src, tmp_path / "keep.gguf", progress=False,
                     transforms={"blk.1.ffn_up.weight": lambda t, d: (d[:10], t.type, t.shape)})
    assert os.listdir(tmp_path) == ["keep.gguf"] and (tmp_path / "keep.gguf").read_bytes() == b"old"


# ---- (e) rewrite_gguf ---------------------------------------------------------------------------
def test_rewrite_copies_exactly(work, tmp_path):
    src = work["src"]
    out = tmp_path / "copy.gguf"
    rewrite_gguf(src, out, progress=False)
    assert out.read_bytes() == src.read_bytes()  # KV pairs, tensor infos, alignment padding, data
    out.unlink()
    rewrite_gguf(src, out, progress=False, remove_prefixes=("general.",),
                 set_kv={"optiml.test.u64": (2**40, GGUFValueType.UINT64), "optiml.test.s": ("hé", None),
                         "optiml.test.strs": (["a", "bc"], GGUFValueType.ARRAY),
                         "general.architecture": ("llama", None)})
    with gguf.open(src) as f0, gguf.open(out) as f1:
        assert f1.metadata["optiml.test.u64"] == 2**40 and f1.metadata_types["optiml.test.u64"] == "uint64"
        assert f1.metadata["optiml.test.s"] == "hé"
        assert list(f1.metadata["optiml.test.strs"]) == ["a", "bc"]
        assert not [k for k in f1.metadata if k.startswith("general.") and k != "general.architecture"]
        for t in f0.tensors:
            assert np.array_equal(f0.tensor_data(t.name), f1.tensor_data(t.name))
    _, spans = read_kv_spans(out)
    assert [k for k, _, _ in spans][-4:] == ["optiml.test.u64", "optiml.test.s", "optiml.test.strs",
                                             "general.architecture"]
    assert struct.unpack_from("<I", out.read_bytes(), 0)[0] == 0x46554747


# ---- (f) optiml info ----------------------------------------------------------------------------
def test_info_shows_placement(work, capsys, tmp_path):
    from optiml.cli import main

    assert main(["info", str(work["placed"])]) == 0
    out = capsys.readouterr().out
    assert "placement (optiml.placement.*" in out and "k_l / n_ff" in out
    assert re.search(r"^\s+0\s+0 / 1536\s+0\.0%", out, re.M)  # layer 0: all on the CPU
    assert "solver: mip Optimal" in out and "total" in out
    assert "form: neuron_order" in out
    if "used with --device cuda" in out:  # (a machine without a GPU): cpu:1 runs the split too, say so
        assert "--device cpu:1" in out
    assert main(["info", str(work["src"])]) == 0
    assert "placement (" not in capsys.readouterr().out


def test_info_says_which_layers_attention_a_small_budget_holds(work, capsys, tmp_path):
    """A budget below the fixed part: info says plainly that only the last layers' attention is on the GPU."""
    from optiml.cli import main

    from types import SimpleNamespace

    pl = SimpleNamespace(**{**dataclasses.asdict(work["placement"]), "vram_budget": 20 * 2**20,
                            "fixed_bytes": 160 * 2**20, "gpu_attention": [False] * 27 + [True] * 3})
    out = tmp_path / "small.gguf"
    write_placed(work["src"], work["stats"], pl, out, progress=False)
    assert main(["info", str(out)]) == 0
    assert ("the budget cannot hold every layer's attention (all of it with the KV cache for ctx 1024, the norms, "
            "the output and the scratch take 160.0 MiB), so the attention (and KV cache) of 3 of 30 layers is on "
            "the GPU: layers 27-29" in capsys.readouterr().out)


def test_info_plot(work, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from optiml.cli import main

    png = tmp_path / "placed.png"
    assert main(["info", str(work["placed"]), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stats = tmp_path / "stats.npz"
    S.save(work["stats"], stats)
    png2 = tmp_path / "unplaced.png"
    assert main(["info", str(work["src"]), "--stats", str(stats), "--plot", str(png2)]) == 0
    assert png2.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["info", str(work["src"]), "--plot", str(tmp_path / "none.png")]) == 1
    assert "--stats" in capsys.readouterr().err
    assert not (tmp_path / "none.png").exists()
