"""The activation-sparse FFN in the engine: exact for ReLU models, dense-equal at threshold 0, the
sparse (one token) and dense-masked (batch) implementations of the same function agreeing, and
calibration hitting its target on held-out text."""

import gguf
import numpy as np
import pytest

import optiml
from optiml.calibrate import calibrate
from optiml.gguf_edit import rewrite_gguf

from conftest import shared_eval_text

V = gguf.GGUFValueType


@pytest.fixture(scope="module")
def relu_paths(smollm2_path, tmp_path_factory):
    """SmolLM2's weights run as ReLU-family models: relu(gate) * up and relu(gate) * relu(up)."""
    d = tmp_path_factory.mktemp("relu")
    out = {}
    for act in ("relu", "relu2"):
        out[act] = str(d / f"smollm2-{act}.gguf")
        rewrite_gguf(smollm2_path, out[act], set_kv={"optiml.ffn.activation": (act, V.STRING)}, progress=False)
    return out


def _ids(m, n):
    return m.tokenize(shared_eval_text())[:n]


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / (np.max(b) - np.min(b)))


@pytest.mark.parametrize("act", ["relu", "relu2"])
def test_relu_sparse_equals_dense(relu_paths, act):
    dense = optiml.Model(relu_paths[act], n_ctx=256, n_threads=2, sparsity="none")
    sparse = optiml.Model(relu_paths[act], n_ctx=256, n_threads=2)  # auto: exact zero-skipping
    assert dense.sparsity == "none" and sparse.sparsity == "exact"
    ids = _ids(dense, 48)
    # A batch: the zeros masked in, the dense kernels: the same bits.
    np.testing.assert_array_equal(sparse.eval(ids, all_logits=True), dense.eval(ids, all_logits=True))
    # One token at a time: only the active neurons' up rows and down columns are read.
    sparse.reset(), dense.reset()
    sparse.eval(ids[:8]), dense.eval(ids[:8])
    sparse.sparsity_stats(reset=True)
    for t in ids[8:24]:
        a, b = sparse.eval([t]), dense.eval([t])
        assert _rel(a, b) < 0.02
        assert np.argmax(a) == np.argmax(b)
    skipped = sparse.sparsity_stats()["skipped"]
    assert skipped > (0.3 if act == "relu" else 0.5), skipped


@pytest.mark.parametrize("criterion", ["gate", "product"])
def test_threshold_zero_equals_dense(smollm2_path, criterion):
    dense = optiml.Model(smollm2_path, n_ctx=128, n_threads=2, sparsity="none")
    sparse = optiml.Model(smollm2_path, n_ctx=128, n_threads=2)
    sparse.set_sparsity("threshold", 0.0, criterion=criterion)
    ids = _ids(dense, 40)
    np.testing.assert_array_equal(sparse.eval(ids[:32], all_logits=True), dense.eval(ids[:32], all_logits=True))
    for t in ids[32:]:
        np.testing.assert_array_equal(sparse.eval([t]), dense.eval([t]))


@pytest.mark.parametrize("criterion", ["gate", "product"])
def test_sparse_token_path_matches_masked_batch_path(smollm2_path, criterion):
    """The same thresholds computed two ways: a batch (dense kernels, inactive activations zeroed) and
    token by token (row-sparse up, column-sparse down over 8-bit neuron-major rows)."""
    m = optiml.Model(smollm2_path, n_ctx=128, n_threads=2)
    m.set_sparsity("threshold", 0.03 if criterion == "product" else 0.05, criterion=criterion)
    ids = _ids(m, 24)
    batch = m.eval(ids, all_logits=True)
    m.reset()
    steps = np.stack([m.eval([t]) for t in ids])
    assert _rel(steps, batch) < 0.05
    assert np.mean(steps.argmax(1) == batch.argmax(1)) > 0.9
    assert m.sparsity_stats()["skipped"] > 0.3


@pytest.mark.parametrize("criterion,target", [("product", 0.5), ("product", 0.3), ("gate", 0.5)])
def test_calibration_hits_target_on_held_out_text(smollm2_path, tmp_path, criterion, target):
    text = shared_eval_text()
    half = len(text) // 2
    out = tmp_path / "cal.gguf"
    cal = calibrate(str(smollm2_path), texts=[text[:half]], target=target, out=out, n_tokens=1024, n_ctx=256,
                    criterion=criterion, progress=False)
    assert cal.threshold.shape == (30,)
    m = optiml.Model(out, n_ctx=256, n_threads=2)
    assert m.sparsity == "calibrated"
    ids = m.tokenize(text[half:])[:768]
    for i in range(0, len(ids), 256):
        m.reset()
        m.eval(ids[i:i + 256])
    skipped = m.sparsity_stats()["skipped"]
    print(f"\n{criterion} target {target}: {skipped:.3f} skipped on held-out text")
    assert abs(skipped - target) < 0.02


def test_bad_sparsity_arguments(smollm2_path, tmp_path):
    m = optiml.Model(smollm2_path, n_ctx=64, n_threads=1)
    assert m.sparsity == "none"  # SwiGLU without calibration: auto is dense
    with pytest.raises(optiml.ArgumentError, match="optiml calibrate"):
        m.set_sparsity("threshold")
    with pytest.raises(optiml.ArgumentError, match="one per layer"):
        m.set_sparsity("threshold", [0.1, 0.2])
    with pytest.raises(optiml.ArgumentError, match=">= 0"):
        m.set_sparsity("threshold", -1.0)
    with pytest.raises(optiml.ArgumentError, match="sparsity must be"):
        m.set_sparsity("fast")
    with pytest.raises(optiml.ArgumentError, match="criterion"):
        m.set_sparsity("threshold", 0.1, criterion="up")
    for kw, msg in [({"target": 1.5}, "target"), ({"criterion": "x"}, "criterion"), ({"allocation": "x"}, "allocation"),
                    ({"out": smollm2_path}, "new file"), ({"out": tmp_path / "no" / "x.gguf"}, "folder")]:
        with pytest.raises(optiml.ArgumentError, match=msg):
            calibrate(str(smollm2_path), texts=["some text"], progress=False, **kw)
    with pytest.raises(optiml.ArgumentError, match="needs data"):
        calibrate(str(smollm2_path), progress=False)


def test_bad_thresholds_in_a_file_are_rejected(smollm2_path, tmp_path):
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(smollm2_path, bad, set_kv={"optiml.sparsity.threshold": ([0.1] * 3, V.ARRAY)}, progress=False)
    with pytest.raises(optiml.GGUFError, match="3 values for 30 layers"):
        optiml.Model(bad)
