"""Activation predictors (optiml.offline.predictors): trained on one text they keep their recall target on another,
a predictor marking every neuron active changes nothing, a file for another model is refused, and training
is deterministic for a seed. The ReLU model is SmolLM2 with its FFN activation set to ReLU (a real
tokenizer and real weights; relu(gate) * up is still a well-defined model, with natural sparsity)."""

import argparse
import filecmp
import shutil
import warnings

import gguf
import numpy as np
import pytest

import optiml
from optiml import cli
from optiml.cli import common
from optiml.offline import predictors as P
from optiml.engine.sparsity import break_even_share
from optiml.formats import predictors as PF
from optiml.formats.gguf_edit import rewrite_gguf
from optiml.formats.stats import model_fingerprint

from conftest import fixed_predictor, shared_eval_text
from hf_gguf import write_and_close


@pytest.fixture(scope="module")
def relu_model(smollm2_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("pred") / "smollm2-relu.gguf"
    rewrite_gguf(str(smollm2_path), str(out), set_kv={"optiml.ffn.activation": ("relu", gguf.GGUFValueType.STRING)},
                 progress=False)
    return str(out)


def _halves():
    text = shared_eval_text()
    return text[: len(text) // 2], text[len(text) // 2:]


@pytest.fixture(scope="module")
def trained(relu_model, tmp_path_factory):
    train, _ = _halves()
    out = str(tmp_path_factory.mktemp("pred") / "p.gguf")
    res = P.train_predictors(relu_model, texts=[train], recall=0.95, out=out, samples=512, max_rank=64,
                             progress=False)
    return res, out


def _all_active(model_path, out):
    """A predictor whose scores are all 1 > threshold 0: every neuron predicted active."""
    hp = optiml.Model(model_path, n_ctx=64, predictors=None).hparams
    L, E, F = hp["n_layer"], hp["n_embd"], hp["n_ff"]
    res = P.PredictorTraining(np.full(L, 32, np.int32), np.zeros(L, np.float32), np.ones(L, np.float32),
                              np.ones(L, np.float32), np.ones(L, np.float32), np.zeros(L, np.float32), 0.99, 0, "q8_0")
    layers = [(np.zeros((32, E), np.float32), np.zeros((F, 32), np.float32), np.ones(F, np.float32))] * L
    PF.write(out, layers, res, model_path, model_fingerprint(model_path), hp)
    return out


def test_trained_predictor_keeps_its_recall_on_other_text(relu_model, trained):
    res, out = trained
    _, test = _halves()
    assert res.rank.min() >= 32 and res.rank.max() <= 64
    q = P.mask_quality(relu_model, out, texts=[test], n_tokens=1024)
    # Calibrated on held-out tokens of the training text for 0.975; on new text the target 0.95 holds.
    assert q["recall_all"] >= 0.95, q["recall_all"]
    assert q["recall"].min() >= 0.93, q["recall"]
    assert q["predicted"].mean() < 0.95  # it does skip neurons
    assert np.all(q["precision"] > q["active"] - 1e-9)  # better than marking everything active

    # In the engine: the neurons computed are about the predicted share (the gate rows of the others
    # are never read). (SmolLM2 was not trained with ReLU, so the dropped 5% of firings move its logits
    # a lot: output quality is measured on real models by tools/bench/predictors.py, not here.)
    ids = optiml.Model(relu_model, n_ctx=256, predictors=None).tokenize(test)[:48]
    m = optiml.Model(relu_model, n_ctx=256, predictors=out)
    assert m.predictors == out
    got = np.stack([m.eval(ids[i:i + 1]) for i in range(len(ids))])
    assert np.all(np.isfinite(got))
    computed = 1 - m.sparsity_stats()["skipped"]
    assert abs(computed - q["predicted"].mean()) < 0.1, (computed, q["predicted"].mean())


def test_all_active_predictor_equals_dense(relu_model, smollm2_path, tmp_path):
    ids = optiml.Model(relu_model, n_ctx=128, predictors=None).tokenize(shared_eval_text())[:24]
    # ReLU, exact zero-skipping: token by token and as one batch, the same logits as without a predictor.
    pred = _all_active(relu_model, str(tmp_path / "all.gguf"))
    base = optiml.Model(relu_model, n_ctx=128, predictors=None)
    m = optiml.Model(relu_model, n_ctx=128, predictors=pred)
    for step in (1, len(ids)):
        base.reset()
        m.reset()
        a = np.concatenate([base.eval(ids[i:i + step], all_logits=True).reshape(-1, base.n_vocab)
                            for i in range(0, len(ids), step)])
        b = np.concatenate([m.eval(ids[i:i + step], all_logits=True).reshape(-1, m.n_vocab)
                            for i in range(0, len(ids), step)])
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * np.abs(a).max())
    # SwiGLU, dense: every neuron computed through the predicted path gives the dense logits.
    pred2 = _all_active(str(smollm2_path), str(tmp_path / "all2.gguf"))
    d = optiml.Model(smollm2_path, n_ctx=128, sparsity="none", predictors=None)
    p = optiml.Model(smollm2_path, n_ctx=128, sparsity="none", predictors=pred2)
    a = np.stack([d.eval(ids[i:i + 1]) for i in range(len(ids))])
    b = np.stack([p.eval(ids[i:i + 1]) for i in range(len(ids))])
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * np.abs(a).max())
    assert p.sparsity_stats()["skipped"] == 0


def test_predictors_use_the_chosen_down_copy(smollm2_path, tmp_path):
    """A gated model with predictors and no sparsity criterion: down_copy reaches the engine (8-bit rows
    or the grouped copy of the file's Q4_1 codes: close, not the same bits), and "auto" takes the grouped
    copy when the predictors mark at least 40% of the neurons active, the 8-bit rows below that."""
    few = fixed_predictor(smollm2_path, str(tmp_path / "few.gguf"), 0.3, 0.3)
    many = fixed_predictor(smollm2_path, str(tmp_path / "many.gguf"), 0.3, 0.6)  # same weights
    ids = optiml.Model(smollm2_path, n_ctx=64, predictors=None).tokenize(shared_eval_text())[:12]

    def steps(pred, copy):
        m = optiml.Model(smollm2_path, n_ctx=64, n_threads=2, sparsity="none", predictors=pred, down_copy=copy)
        out = np.stack([m.eval([t]) for t in ids])
        assert 0.6 < m.sparsity_stats()["skipped"] < 0.8
        return out

    fast, compact = steps(few, "fast"), steps(few, "compact")
    assert not np.array_equal(fast, compact)
    # The same neurons and activations; the grouped copy sums the file's exact weights with each group's
    # activations rounded to int8, the 8-bit rows round the weights instead. SmolLM2 amplifies such
    # rounding over its 30 layers to about 0.1 of the largest logit (test_sparse_ffn: each path about
    # 0.09 from the dense model); a wrong neuron or copy would move logits by their own size.
    assert float(np.max(np.abs(fast - compact)) / np.max(np.abs(fast))) < 0.15
    assert np.array_equal(steps(few, "auto"), fast)
    assert np.array_equal(steps(many, "auto"), compact)


def test_predictor_for_another_model_is_refused(relu_model, smollm2_path, gemma3_path, trained, tmp_path):
    _, out = trained
    with pytest.raises(PF.PredictorMismatchError, match="trained for another model"):
        optiml.Model(gemma3_path, n_ctx=64, predictors=out)
    with pytest.raises(PF.PredictorMismatchError, match="activation was relu"):  # same tensors, other FFN
        optiml.Model(smollm2_path, n_ctx=64, predictors=out)
    with pytest.raises(optiml.ArgumentError, match="another model"):
        optiml.Model(smollm2_path, n_ctx=64, predictors=None).set_predictors(out)
    with pytest.raises(FileNotFoundError):
        optiml.Model(relu_model, n_ctx=64, predictors=str(tmp_path / "missing.gguf"))
    with pytest.raises(optiml.ArgumentError, match="not a predictor file"):
        optiml.Model(relu_model, n_ctx=64, predictors=str(smollm2_path))
    # Shapes are checked natively too (a file that passed the fingerprint check by other means).
    m = optiml.Model(smollm2_path, n_ctx=64, predictors=None)
    g3 = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(g3), "optiml-predictor")
    w.add_array("optiml.predictor.threshold", [0.0] * m.hparams["n_layer"])
    w.add_tensor("blk.0.ffn_pred_a.weight", np.zeros((32, 64), np.float16))
    write_and_close(w)
    with pytest.raises(optiml.GGUFError, match="another model"):
        m._session.set_predictors(str(g3))
    # Auto-discovery: MODEL.predictors.gguf beside MODEL.gguf.
    copy = tmp_path / "relu.gguf"
    shutil.copy(relu_model, copy)
    shutil.copy(out, tmp_path / "relu.predictors.gguf")
    assert optiml.Model(str(copy), n_ctx=64).predictors == str(tmp_path / "relu.predictors.gguf")
    assert optiml.Model(str(copy), n_ctx=64, predictors=None).predictors is None


def test_auto_leaves_predictors_unused_where_they_would_slow_decoding(relu_model, smollm2_path, tmp_path, capsys):
    """predictors="auto" takes MODEL.predictors.gguf only while the share of neurons it predicts active on
    held-out text (the file's record) is under the break-even of the model's FFN kind; above it a
    PredictorWarning names the file and the share, and an explicit path still uses it."""
    for model, act, below, above in ((smollm2_path, "silu", 0.3, 0.6), (relu_model, "relu", 0.7, 0.9)):
        limit = break_even_share(act)
        assert below < limit < above
        d = tmp_path / act
        d.mkdir()
        copy = d / "m.gguf"
        shutil.copy(model, copy)
        beside = str(d / "m.predictors.gguf")
        fixed_predictor(copy, beside, 0.3, below)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # none expected
            assert optiml.Model(str(copy), n_ctx=64).predictors == beside
        fixed_predictor(copy, beside, 0.3, above)
        with pytest.warns(optiml.PredictorWarning, match=rf"not using .*m\.predictors\.gguf: .* {above:.1%} of the FFN") as rec:
            m = optiml.Model(str(copy), n_ctx=64)
        assert m.predictors is None and rec[0].filename == __file__  # points at the caller
        assert optiml.Model(str(copy), n_ctx=64, predictors=beside).predictors == beside
    # The command line says it in a log line (not a Python warning), and -q silences it.
    from optiml import cli

    for quiet, expect in ((False, f"optiml run: not using {beside}"), (True, "")):
        common.quiet = quiet
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = cli._warning_line("run")  # (main's hook; catch_warnings puts it back)
                m = common.load(argparse.Namespace(model=str(copy), ctx=64, threads=None))
        finally:
            common.quiet = False
        assert m.predictors is None
        err = capsys.readouterr().err
        assert err.startswith(expect) if expect else err == ""


def test_training_is_deterministic_for_a_seed(relu_model, tmp_path):
    train, _ = _halves()
    outs = [str(tmp_path / f"{i}.gguf") for i in range(3)]
    for out, seed in zip(outs, (7, 7, 8)):
        P.train_predictors(relu_model, texts=[train], out=out, samples=128, max_rank=32, seed=seed, progress=False)
    assert filecmp.cmp(outs[0], outs[1], shallow=False)
    assert not filecmp.cmp(outs[0], outs[2], shallow=False)


def test_bad_training_arguments(relu_model, tmp_path):
    with pytest.raises(optiml.ArgumentError, match="recall"):
        P.train_predictors(relu_model, texts=["x"], recall=1.0)
    with pytest.raises(optiml.ArgumentError, match="samples"):
        P.train_predictors(relu_model, texts=["x"], samples=3)
    with pytest.raises(optiml.ArgumentError, match="output must be a new file"):
        P.train_predictors(relu_model, texts=["x"], out=relu_model)
    with pytest.raises(optiml.ArgumentError, match="at least 64"):
        P.train_predictors(relu_model, texts=["a few words"], out=str(tmp_path / "p.gguf"), progress=False)


def test_planted_firing_is_learnable_at_its_rank(smollm2_path, tmp_path):
    """tools/make_synthetic_model.py --plant-rank R (the hybrid benchmark's model): firing planted in an
    R-dimensional subspace is learned at rank R with nearly no extra neurons predicted, where the same
    planted rates without it need a larger rank and predict several times the active share."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "make_synthetic_model.py"
    text = shared_eval_text()
    got = {}
    for name, extra in (("flat", []), ("ranked", ["--plant-rank", "32"])):
        path = tmp_path / f"{name}.gguf"
        subprocess.run([sys.executable, str(tool), "-o", str(path), "--n-embd", "256", "--n-layer", "2", "--n-ff",
                        "1024", "--n-head", "4", "--n-head-kv", "4", "--activation", "relu", "--plant-firing", "0.1",
                        "--quiet", "--tokenizer-from", str(smollm2_path), *extra], check=True)
        got[name] = P.train_predictors(path, texts=[text], recall=0.99, samples=1024, progress=False, n_threads=2)
    ranked, flat = got["ranked"], got["flat"]
    assert (ranked.recall >= 0.99).all() and (flat.recall >= 0.99).all()
    assert (ranked.rank <= 32).all() and (flat.rank > 32).all()
    assert (ranked.predicted < 1.5 * ranked.active).all()  # planted active share 0.1
    assert (flat.predicted > 2 * flat.active).all()
    bad = subprocess.run([sys.executable, str(tool), "-o", str(tmp_path / "x.gguf"), "--plant-rank", "8"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--plant-rank needs --plant-firing" in bad.stderr


def test_a_gate_of_rank_between_the_stored_ranks_trains(smollm2_path, tmp_path):
    """A gate whose samples span fewer directions than the rank chosen (planted rank 90 of n_embd 256: 104
    directions, and rank 128 the cheapest) is stored at that rank with the missing directions zero; it used to
    fail to quantize B's rows of 104 values into Q8_0 blocks of 32."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "make_synthetic_model.py"
    path, out = tmp_path / "r90.gguf", tmp_path / "r90.pred.gguf"
    subprocess.run([sys.executable, str(tool), "-o", str(path), "--n-embd", "256", "--n-layer", "2", "--n-ff", "1024",
                    "--n-head", "4", "--n-head-kv", "4", "--activation", "relu", "--plant-firing", "0.1",
                    "--plant-rank", "90", "--quiet", "--tokenizer-from", str(smollm2_path)], check=True)
    r = P.train_predictors(path, texts=[shared_eval_text()], recall=0.99, samples=1024, out=out, progress=False,
                           n_threads=2)
    assert (r.rank % 32 == 0).all() and (r.recall >= 0.99).all() and (r.predicted < 1.5 * r.active).all()
    with optiml.Model(path, n_ctx=64, predictors=out) as m:
        assert m.eval(list(range(100, 108))).shape == (m.n_vocab,)
