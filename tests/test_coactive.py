"""Co-active neurons side by side (`optiml solve --order coactive`, optiml.offline.coactive), the CPU's copy
of a layer in a file's placed order, and predictors that decide by groups of neurons."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import optiml
from optiml._core import ArgumentError
from optiml.formats.gguf_edit import GGUFValueType as VT
from optiml.formats.gguf_edit import rewrite_gguf
from optiml.formats.placement import read_placement
from optiml.offline.coactive import coactive_order, run_lengths

from conftest import ROOT, child_env, fixed_predictor, llama_cpp_module, model_path, tiny_model

sys.path.insert(0, str(ROOT / "tools"))
from make_synthetic_model import cluster_layout  # noqa: E402

TEXT = ROOT / "tests" / "data" / "scandal-in-bohemia.txt"


def planted_masks(n_tokens, n_ff, size, seed=0, stray=0.03, miss=0.05):
    """Firing masks of clusters of `size` neurons scattered through the layer: a cluster fires for half of
    the tokens, each member with it but for `miss` of the time, plus `stray` random firings."""
    rng = np.random.default_rng(seed)
    of = rng.permutation(n_ff) % (n_ff // size)
    on = rng.random((n_tokens, n_ff // size)) < 0.5
    m = on[:, of] & (rng.random((n_tokens, n_ff)) >= miss) | (rng.random((n_tokens, n_ff)) < stray)
    return m, of


def test_run_lengths_count_runs_of_active_rows():
    m = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=bool)
    assert run_lengths(m, np.arange(4)) == pytest.approx(5 / 4)  # runs: [2, 1], [], [1, 1]
    assert run_lengths(m, np.array([0, 1, 3, 2])) == pytest.approx(5 / 3)  # [3], [], [1, 1]
    assert run_lengths(np.zeros((2, 3), bool), np.arange(3)) == 0.0


def test_coactive_order_puts_planted_clusters_together():
    m, of = planted_masks(1024, 1024, 32)
    fit, held = m[0::2], m[1::2]
    order = coactive_order(fit)
    assert sorted(order.tolist()) == list(range(1024))
    same = np.mean(of[order[1:]] == of[order[:-1]])
    assert same > 0.9, f"only {same:.2f} of adjacent neurons share a cluster"
    before, after = run_lengths(held, np.arange(1024)), run_lengths(held, order)
    assert after > 4 * before, (before, after)


def test_coactive_order_of_a_subset_keeps_to_it():
    m, _ = planted_masks(256, 256, 16)
    subset = np.arange(64, 256, 3)
    order = coactive_order(m, subset)
    assert sorted(order.tolist()) == subset.tolist()
    with pytest.raises(ArgumentError, match="--samples"):
        coactive_order(np.zeros((0, 8), bool))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tiny_model(tmp_path_factory.mktemp("co") / "tiny.gguf"))


@pytest.fixture(scope="module")
def placed(tiny, tmp_path_factory):
    """tiny with a random neuron order recorded (its weights kept where they are)."""
    rng = np.random.default_rng(3)
    order = np.concatenate([rng.permutation(128) for _ in range(2)]).astype(np.int32)
    out = tmp_path_factory.mktemp("co") / "placed.gguf"
    rewrite_gguf(tiny, str(out), set_kv=order_kv(order, "coactive"), progress=False)
    return str(out)


def order_kv(order, name):
    return {"optiml.placement.version": (2, VT.UINT32),
            "optiml.placement.gpu_neurons": (np.zeros(2, np.int32), VT.ARRAY),
            "optiml.placement.neuron_order": (order, VT.ARRAY), "optiml.placement.order": (name, VT.STRING)}


def logits_of(path, pred, group=1, **kw):
    m = optiml.Model(path, n_ctx=128, n_threads=2, predictors=pred, predictor_group=group, **kw)
    ids = m.tokenize(TEXT.read_text(encoding="utf-8")[:2000])[:40]
    prompt = np.array(m.eval(ids[:32]), dtype=np.float64)
    steps = [np.array(m.eval([t]), dtype=np.float64) for t in ids[32:40]]
    skipped = m.sparsity_stats()["skipped"]
    copy = m.placed_copy_info()
    m.close()
    return prompt, np.array(steps), skipped, copy


def test_placed_copy_computes_what_the_file_order_computes(tiny, placed, tmp_path):
    pred = fixed_predictor(tiny, tmp_path / "p.gguf", active=0.5, recorded_share=0.5)
    p0, s0, skip0, copy0 = logits_of(tiny, pred)
    p1, s1, skip1, copy1 = logits_of(placed, pred)
    assert copy0 == {"layers": [], "bytes": 0}
    assert copy1["layers"] == [0, 1] and copy1["bytes"] > 0
    assert skip1 == pytest.approx(skip0) and 0.3 < skip0 < 0.7
    np.testing.assert_array_equal(p1, p0)  # a prompt's down product runs dense, in the file's order
    np.testing.assert_allclose(s1, s0, rtol=0, atol=1e-4 * np.abs(s0).max())  # only the sum's order differs
    # Without predictors the placed file runs from its weights as stored: no copy.
    m = optiml.Model(placed, n_ctx=64, predictors=None)
    assert m.placed_copy_info()["layers"] == []
    m.close()
    # Nor with a hot-first order (the solver's usual one): a copy would read no longer runs.
    rng = np.random.default_rng(5)
    hot = tmp_path / "hot.gguf"
    rewrite_gguf(tiny, str(hot), set_kv=order_kv(np.concatenate([rng.permutation(128) for _ in range(2)])
                                                 .astype(np.int32), "hot-first"), progress=False)
    m = optiml.Model(str(hot), n_ctx=64, predictors=pred)
    assert m.placed_copy_info()["layers"] == []
    m.close()


def test_detaching_predictors_frees_the_copies_and_keeps_the_criterion(tiny, placed, tmp_path):
    pred = fixed_predictor(tiny, tmp_path / "p.gguf", active=0.5, recorded_share=0.5)
    ids = optiml.Model(tiny, n_ctx=64).tokenize(TEXT.read_text(encoding="utf-8")[:500])[:24]

    def skipped(m):
        m.reset()
        m.sparsity_stats(reset=True)
        for t in ids:
            m.eval([t])
        return m.sparsity_stats()["skipped"]

    for path in (tiny, placed):  # the same share skipped by the threshold, copies or not
        m = optiml.Model(path, n_ctx=64, predictors=pred, sparsity="threshold", thresholds=0.05)
        m._session.set_predictors(None)  # the native call alone, as the Python wrapper's first step
        assert m.placed_copy_info() == {"layers": [], "bytes": 0}
        if path == tiny:
            expected = skipped(m)
            assert expected > 0.05
        else:
            assert skipped(m) == pytest.approx(expected)
        m.close()


def test_group_prediction_computes_whole_groups(tiny, placed, tmp_path):
    pred = fixed_predictor(tiny, tmp_path / "p.gguf", active=0.3, recorded_share=0.3)
    _, _, skip1, _ = logits_of(placed, pred, group=1)
    _, _, skip8, _ = logits_of(placed, pred, group=8)
    p_all, s_all, skip_all, _ = logits_of(placed, pred, group=128)  # one group: any prediction computes all
    pd, sd, _, _ = logits_of(tiny, None, sparsity="none")
    assert skip_all == 0.0 and skip8 < skip1
    assert 0.6 < skip1 < 0.8
    # Every neuron computed: the dense function (the sums in another order).
    np.testing.assert_allclose(s_all, sd, rtol=0, atol=1e-4 * np.abs(sd).max())
    np.testing.assert_allclose(p_all, pd, rtol=0, atol=1e-4 * np.abs(pd).max())
    for bad in (0, 129, -1):
        with pytest.raises(ArgumentError, match="predictor_group"):
            optiml.Model(tiny, n_ctx=64, predictor_group=bad)


def run_cli(*args):
    r = subprocess.run([sys.executable, "-m", "optiml", *args], capture_output=True, text=True, env=child_env())
    return r.returncode, r.stdout + r.stderr


def test_solve_orders_a_clustered_model_by_coactivation(tmp_path):
    donor = model_path("smollm2-135m-instruct-q4_1")
    path = tmp_path / "clusters.gguf"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_synthetic_model.py"), "-o", str(path), "--quiet",
                    "--n-embd", "128", "--n-layer", "2", "--n-ff", "512", "--n-head", "2", "--n-head-kv", "2",
                    "--type", "q8_0", "--plant-clusters", "16", "--cluster-share", "0.95",
                    "--tokenizer-from", str(donor)], check=True, capture_output=True, env=child_env())
    stats = tmp_path / "s.npz"
    rc, out = run_cli("profile", "-m", str(path), "--data", str(TEXT), "--tokens", "1024", "--samples", "1024",
                      "-o", str(stats))
    assert rc == 0, out
    placed = tmp_path / "placed.gguf"
    rc, out = run_cli("solve", "-m", str(path), "--stats", str(stats), "--vram", "0", "--order", "coactive",
                      "-o", str(placed))
    assert rc == 0, out
    assert "co-activation order" in out
    pl = read_placement(str(placed))
    assert pl["order"] == "coactive"
    rc, out = run_cli("info", str(placed))
    assert rc == 0 and "co-activation order" in out, out
    order = pl["neuron_order"]
    for layer in range(2):
        of, _ = cluster_layout(0, layer, 512, 16, 128)
        o = order[layer]
        assert sorted(o.tolist()) == list(range(512))
        same = np.mean(of[o[1:]] == of[o[:-1]])
        assert same > 0.8, f"layer {layer}: {same:.2f} of adjacent neurons share a cluster"
    # Stats without sampled masks: refused, saying what to do.
    bare = tmp_path / "bare.npz"
    assert run_cli("profile", "-m", str(path), "--data", str(TEXT), "--tokens", "256", "-o", str(bare))[0] == 0
    rc, out = run_cli("solve", "-m", str(path), "--stats", str(bare), "--vram", "0", "--order", "coactive",
                      "-o", str(tmp_path / "x.gguf"))
    assert rc != 0 and "--samples" in out and "Traceback" not in out


def test_split_layers_read_the_hosts_neurons_from_a_placed_copy(placed, tiny, tmp_path):
    """A split layer (cpu:1 standing in for a GPU): the host's placed neurons [k, n_ff) come from the copy,
    computing what they compute read in place (placed_copy=False)."""
    pred = fixed_predictor(tiny, tmp_path / "p.gguf", active=0.5, recorded_share=0.5)
    kw = dict(device="cpu:1", gpu_neurons=32)
    p0, s0, skip0, copy0 = logits_of(placed, pred, placed_copy=False, **kw)
    p1, s1, skip1, copy1 = logits_of(placed, pred, **kw)
    assert copy0 == {"layers": [], "bytes": 0} and copy1["layers"] == [0, 1]
    assert skip1 == pytest.approx(skip0) and 0.2 < skip0 < 0.6
    np.testing.assert_array_equal(p1, p0)  # a prompt's down product runs dense, in the file's order
    np.testing.assert_allclose(s1, s0, rtol=0, atol=1e-4 * np.abs(s0).max())
    # Host-only layers too, and the copies freed when turned off.
    m = optiml.Model(placed, n_ctx=64, predictors=pred)
    assert m.placed_copy_info()["layers"] == [0, 1]
    m._session.placed_copies = False
    assert m.placed_copy_info() == {"layers": [], "bytes": 0}
    m.close()


def test_the_benchmark_runs_and_finds_the_clusters(tmp_path):
    """tools/bench/coactive.py end to end on its tiny model (one repeat): the co-activation order reads the
    forced predictor's rows in far longer runs than the file's order."""
    import json

    llama_cpp_module()  # the benchmark's peer
    out = tmp_path / "coactive.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "coactive.py"), "--tiny", "--cluster", "16",
                        "--groups", "16", "--repeats", "1", "--n-gen", "4", "--samples", "512", "--model-dir",
                        str(tmp_path), "--json", str(out)], capture_output=True, text=True, env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["ffn"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["co-active"]["mean_run"] > 4 * rows["file order"]["mean_run"]
    assert rows["co-active"]["placed_copy_bytes"] > 0 and rows["file order"]["placed_copy_bytes"] == 0
    assert 0.3 < rows["co-active"]["computed"] < 0.7


def test_info_says_the_cpu_reads_the_order_with_predictors(tiny, placed, tmp_path):
    """optiml info (engine.companions) on a kept-order file with a co-activation order: on the CPU the order is
    read only with predictors, from a copy of the gate and up rows made at load, as the loaded model holds."""
    import shutil

    from optiml.engine.companions import companions

    path = str(tmp_path / "placed.gguf")
    shutil.copyfile(placed, path)
    pl = companions(path)["placement"]
    assert pl["in_file"] and not pl["used"] and "only with predictors" in pl["why"], pl
    fixed_predictor(tiny, tmp_path / "placed.predictors.gguf", active=0.3, recorded_share=0.3)
    c = companions(path)
    assert c["predictors"]["used"], c["predictors"]
    pl = c["placement"]
    assert pl["used"] and "coactive order" in pl["why"], pl
    with optiml.Model(path, n_ctx=64) as m:
        held = m.placed_copy_info()
    assert held["layers"] == [0, 1] and 0 < pl["copy_bytes"] <= held["bytes"]
