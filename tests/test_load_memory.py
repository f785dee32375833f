"""Model(use_mmap=...): weights mapped from the file, or read into private (huge-page) memory."""

import numpy as np
import pytest

import optiml
from optiml.engine import loading
from optiml.util import memory


def test_in_memory_runs_the_same_bits_as_mapped(smollm2_path):
    ids = list(range(100, 140))
    mapped = optiml.Model(smollm2_path, n_ctx=128, n_threads=2, use_mmap=True)
    copied = optiml.Model(smollm2_path, n_ctx=128, n_threads=2, use_mmap=False)
    assert not mapped.in_memory and copied.in_memory
    a = mapped.eval(ids, all_logits=True)
    b = copied.eval(ids, all_logits=True)
    assert np.array_equal(a, b)  # the same bytes, the same kernels
    assert np.array_equal(mapped.eval([7]), copied.eval([7]))


def _decode_four(m, ids):
    # Four sequences of different lengths, then three steps advancing all four together.
    m.kv_clear()
    b = optiml.Batch()
    for s in range(4):
        b.add_sequence(ids[: 5 + 3 * s], seq=s)
    out = [m.decode(b)]
    for step in range(3):
        b.clear()
        for s in range(4):
            b.add(int(out[-1][s].argmax()), s, 5 + 3 * s + step, logits=True)
        out.append(m.decode(b))
    return np.concatenate(out)


def test_rows16_layout_runs_the_same_bits(smollm2_path):
    # A CPU-only model read into memory keeps its dense Q4_1 matrices in the rows16 layout where the
    # kernels have its product (AVX-512VNNI; the Q8_0 output stays in rows): prompts and batches of
    # sequences give the mapped model's bits. Turning sparsity on puts the FFN back into rows (the sparse
    # kernels read rows, but for the gate the criterion computes densely), with the mapped model's sparse
    # bits; dense again, the FFN is repacked.
    ids = list(range(300, 330))
    mapped = optiml.Model(smollm2_path, n_ctx=64, n_threads=2, n_seq=4, use_mmap=True)
    copied = optiml.Model(smollm2_path, n_ctx=64, n_threads=2, n_seq=4, use_mmap=False)
    np.testing.assert_array_equal(_decode_four(copied, ids), _decode_four(mapped, ids))
    n_layer = copied.hparams["n_layer"]
    every = 7 * n_layer  # q, k, v, o, gate, up, down per layer
    assert mapped._model.rows16_matrices == 0
    assert copied._model.rows16_matrices == (every if optiml._core.has_rows16() else 0)
    for m in (mapped, copied):
        m.set_sparsity("threshold", thresholds=0.05)
    # q, k, v, o and the gate, which the criterion computes densely for every neuron (session.cpp's
    # place_weights); up and down go back into rows
    assert copied._model.rows16_matrices == (5 * n_layer if optiml._core.has_rows16() else 0)
    np.testing.assert_array_equal(copied.eval(ids, all_logits=True), mapped.eval(ids, all_logits=True))
    for m in (mapped, copied):
        m.set_sparsity("none")
    np.testing.assert_array_equal(_decode_four(copied, ids), _decode_four(mapped, ids))
    assert copied._model.rows16_matrices == (every if optiml._core.has_rows16() else 0)


def test_in_memory_sparse_path(gemma3_path):
    # the sparse FFN's copies are made from the in-memory weights as from mapped ones
    ids = list(range(200, 230))
    out = []
    for use_mmap in (True, False):
        m = optiml.Model(gemma3_path, n_ctx=64, n_threads=2, use_mmap=use_mmap, sparsity="threshold",
                         thresholds=0.05)
        out.append(m.eval(ids, all_logits=True))
    assert np.array_equal(out[0], out[1])


@pytest.mark.parametrize("bad", ["yes", 0, None, "mmap"])
def test_use_mmap_rejects(smollm2_path, bad):
    with pytest.raises(optiml.ArgumentError, match="use_mmap must be True, False or 'auto'"):
        optiml.Model(smollm2_path, n_ctx=64, use_mmap=bad)


@pytest.fixture
def roomy(monkeypatch):
    """An OS with transparent huge pages and plenty of memory, whatever this machine has."""
    monkeypatch.setattr(memory, "huge_pages_allowed", lambda: True)
    monkeypatch.setattr(memory, "memory_available", lambda: 1 << 40)


def test_auto_follows_the_plan(smollm2_path, roomy):
    # every layer on the CPU: read into memory (n_gpu_layers / gpu_neurons are ignored there, as the
    # plan says); a device instance holding layers: mapped (its weights need no private host copy)
    assert optiml.Model(smollm2_path, n_ctx=64, device="cpu").in_memory
    assert optiml.Model(smollm2_path, n_ctx=64, device="cpu", n_gpu_layers=4).in_memory
    m = optiml.Model(smollm2_path, n_ctx=64, device="cpu:1", vram="64MiB")
    assert m.plan.device == "cpu:1" and not m.in_memory


def test_auto_asks_the_plan_last(smollm2_path, roomy, monkeypatch):
    p = str(smollm2_path)
    calls = []
    plan = lambda: calls.append(1) or {"device": "cpu"}  # noqa: E731
    assert loading.auto_in_memory(p, plan) and calls == [1]
    assert not loading.auto_in_memory(p, lambda: {"device": "cuda:0"})

    def refused():
        raise optiml.ArgumentError("no such device")

    assert not loading.auto_in_memory(p, refused)  # the session then reports it
    monkeypatch.setattr(memory, "memory_available", lambda: smollm2_path.stat().st_size)  # < 2x the file
    assert not loading.auto_in_memory(p, plan) and calls == [1]
    monkeypatch.setattr(memory, "memory_available", lambda: None)
    assert not loading.auto_in_memory(p, plan)
    monkeypatch.setattr(memory, "memory_available", lambda: 1 << 40)
    monkeypatch.setattr(memory, "huge_pages_allowed", lambda: False)
    assert not loading.auto_in_memory(p, plan) and calls == [1]


def test_memory_available_is_a_positive_count():
    got = memory.memory_available()
    assert got is None or got >= 0


def test_the_commands_pass_use_mmap(smollm2_path, monkeypatch):
    from optiml import cli
    from optiml.cli import common

    seen = []

    class FakeModel:
        def __init__(self, path, **kw):
            seen.append(kw["use_mmap"])
            raise SystemExit(0)

    monkeypatch.setattr(common, "Model", FakeModel)
    for flag in ([], ["--mmap"], ["--no-mmap"]):
        with pytest.raises(SystemExit):
            cli.main(["run", "-m", str(smollm2_path), "-p", "hi", "-n", "1", *flag])
    assert seen == ["auto", True, False]


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 100])
def test_bad_files_fail_alike(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    msgs = []
    for use_mmap in (True, False):
        with pytest.raises(optiml.OptimlError) as e:
            optiml.Model(bad, use_mmap=use_mmap)
        msgs.append((type(e.value), str(e.value)))
    assert msgs[0] == msgs[1]


def test_rows16_with_two_sessions_on_one_model(smollm2_path):
    # Sessions may share a Model (the native API). The layout serves one session only: a second one
    # puts every matrix back into rows before it runs, so a sparse session and a dense one take turns
    # on the same in-memory weights with the mapped model's bits.
    from optiml import _core

    ids = np.arange(400, 424, dtype=np.int32)
    ref_model = _core.Model(str(smollm2_path))  # mapped: rows
    ref_dense = _core.Session(ref_model, 64, 2, "f32").eval(ids, True)
    ref_sparse_s = _core.Session(ref_model, 64, 2, "f32")
    ref_sparse_s.set_sparsity(True, np.full(ref_model.hparams["n_layer"], 0.05, np.float32))
    ref_sparse = ref_sparse_s.eval(ids, True)

    m = _core.Model(str(smollm2_path), in_memory=True)
    dense = _core.Session(m, 64, 2, "f32")
    np.testing.assert_array_equal(dense.eval(ids, True), ref_dense)
    alone = m.rows16_matrices
    assert alone == (7 * m.hparams["n_layer"] if _core.has_rows16() else 0)
    sparse = _core.Session(m, 64, 2, "f32")
    assert m.rows16_matrices == 0  # two sessions: rows
    sparse.set_sparsity(True, np.full(m.hparams["n_layer"], 0.05, np.float32))
    dense.kv_clear(-1)
    np.testing.assert_array_equal(dense.eval(ids, True), ref_dense)
    np.testing.assert_array_equal(sparse.eval(ids, True), ref_sparse)
    assert m.rows16_matrices == 0


def test_profile_after_a_dense_run_in_rows16(smollm2_path):
    # The recorder reads the down matrices when it is made; a dense run before may have left them in
    # the rows16 layout. Its down-column norms equal the mapped model's.
    from optiml.offline.profile import profile as run_profile

    stats = []
    for use_mmap in (True, False):
        m = optiml.Model(smollm2_path, n_ctx=128, n_threads=2, use_mmap=use_mmap, sparsity="none")
        m.eval(list(range(50, 60)))
        stats.append(run_profile(m, None, texts=["The quick brown fox jumps over the lazy dog."], n_tokens=64,
                                 threshold=0.05, progress=False))
    np.testing.assert_array_equal(stats[0].down_norm, stats[1].down_norm)
    np.testing.assert_array_equal(stats[0].freq, stats[1].freq)
