"""Sparsity you can see (issue #47): bench, perplexity, run and the server's /metrics say which sparsity mode and
predictor file are in use and the measured share of FFN neurons skipped (per step and mean); info says which
companion files it found beside the model and whether a Model will use them, and why not.

The model is SmolLM2 (a real file, linked under another name) with a fixed predictor beside it: one that marks
the same neurons active at every token (zero low-rank part, random biases against the threshold), so every
step skips the same share, which optiml.Model's own sparsity_stats() measures as the oracle."""

import json
import os
import re
import subprocess
import sys

import pytest

import optiml
from optiml import cli
from optiml.engine.companions import companions
from optiml.engine.sparsity import break_even_share

from conftest import child_env, fixed_predictor

TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled "
        "into his breast in an effort to escape the vile wind, slipped quickly through the glass doors. ") * 4


@pytest.fixture(scope="module")
def with_predictors(smollm2_path, tmp_path_factory):
    """(model path, predictor path beside it, the share of neurons it makes each step skip)."""
    d = tmp_path_factory.mktemp("visible")
    model = d / "m.gguf"
    os.symlink(smollm2_path, model)
    pred = fixed_predictor(model, d / "m.predictors.gguf", active=0.3, recorded_share=0.3)
    with optiml.Model(str(model), n_ctx=64, n_threads=2) as m:
        assert m.predictors == pred  # "auto" takes it: 30% active is under the break-even
        m.eval(m.tokenize("The capital of France is"))
        skipped = m.sparsity_stats()["skipped"]
    assert 0.6 < skipped < 0.8
    return str(model), pred, skipped


def test_meter_per_step_and_mean(with_predictors):
    """Model.sparsity_meter: one share per step, the token-weighted mean, the spread; a predictor that marks
    the same neurons at every token skips the same share at every step."""
    model, pred, skipped = with_predictors
    with optiml.Model(model, n_ctx=64, n_threads=2) as m:
        meter = m.sparsity_meter()
        assert meter.step() is None and meter.summary()["skipped"] is None  # nothing ran yet
        m.eval(m.tokenize("The capital of France is"))
        assert meter.step() == pytest.approx(skipped, abs=1e-12)
        for t in (11, 12, 13):
            m.eval([t])
            meter.step()
        s = meter.summary()
        assert s["mode"] == "none" and s["predictors"] == pred
        assert s["steps"] == 4 and s["tokens"] == len(m.tokenize("The capital of France is")) + 3
        assert s["skipped"] == pytest.approx(skipped, abs=1e-12)
        assert s["per_step"]["min"] == pytest.approx(s["per_step"]["max"], abs=1e-12)
        m.set_predictors(None)  # counts reset: the next step starts from zero
        m.eval([14])
        assert meter.step() == 0.0 and meter.summary()["skipped"] < skipped


def test_bench_reports_sparsity_in_use_and_skipped(with_predictors, capfd):
    model, pred, skipped = with_predictors
    args = ["bench", "-m", model, "-p", "8", "-n", "4", "-r", "1", "-t", "2"]
    assert cli.main(["-q", *args, "--json"]) == 0
    pp, tg = (r["sparsity"] for r in json.loads(capfd.readouterr().out))
    for sp in (pp, tg):
        assert sp["mode"] == "none" and sp["predictors"] == pred
    assert pp["pp"]["skipped"] == pytest.approx(skipped, abs=1e-9) and "tg" not in pp
    assert tg["tg"]["skipped"] == pytest.approx(skipped, abs=1e-9) and "pp" not in tg
    assert tg["tg"]["per_step"]["min"] == pytest.approx(skipped, abs=1e-9)
    assert tg["tg"]["per_step"]["max"] == pytest.approx(skipped, abs=1e-9)
    assert cli.main([*args, "--predictors", "none"]) == 0
    out = capfd.readouterr().out
    assert "FFN: sparsity none (dense), predictors none\n" in out  # (dense skips nothing: no figures)
    assert cli.main(args) == 0
    out = capfd.readouterr().out
    assert f"predictors m.predictors.gguf; neurons skipped: pp8 {skipped:.1%}, tg4 {skipped:.1%} mean" in out


def test_run_logs_sparsity_and_skipped(with_predictors, capfd):
    model, pred, skipped = with_predictors
    assert cli.main(["run", "-m", model, "-p", "The capital of France is", "-n", "6", "--temp", "0", "-t", "2"]) == 0
    out, err = capfd.readouterr()
    assert out.strip() and "FFN" not in out  # the text alone on stdout
    assert (f"FFN: sparsity none (dense), predictors m.predictors.gguf; neurons skipped: prompt {skipped:.1%}, "
            f"generation {skipped:.1%} mean (per step {skipped:.1%} to {skipped:.1%}") in err
    assert cli.main(["-q", "run", "-m", model, "-p", "Hi", "-n", "2", "-t", "2"]) == 0
    assert capfd.readouterr().err == ""


def test_perplexity_reports_sparsity(with_predictors, tmp_path, capfd):
    model, pred, skipped = with_predictors
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    base = ["perplexity", "-m", model, "-f", str(text), "--ctx", "64", "-t", "2"]
    assert cli.main([*base, "--json", "-q"]) == 0
    r = json.loads(capfd.readouterr().out)
    assert r["sparsity"]["predictors"] == pred and r["sparsity"]["mode"] == "none"
    assert r["sparsity"]["skipped"] == pytest.approx(skipped, abs=1e-9)
    assert r["sparsity"]["skipped_per_window"]["max"] == pytest.approx(skipped, abs=1e-9)
    # --kl-divergence: what the sparsity bought, beside the KLD
    kld = str(tmp_path / "base.kld")
    assert cli.main([*base, "--predictors", "none", "--kl-divergence-base", kld, "-q"]) == 0
    capfd.readouterr()
    assert cli.main(["perplexity", "-m", model, "--kl-divergence-base", kld, "--kl-divergence", "-t", "2"]) == 0
    out = capfd.readouterr().out
    assert "Mean    KLD:" in out
    assert f"predictors m.predictors.gguf; neurons skipped: {skipped:.1%} mean" in out.splitlines()[0]


def test_info_names_companions_and_why(with_predictors, smollm2_path, gemma3_path, tmp_path, capfd):
    model, pred, _ = with_predictors
    c = companions(model)
    assert c["sparsity"]["mode"] == "none" and "not ReLU-family" in c["sparsity"]["why"]
    assert c["predictors"]["found"] and c["predictors"]["used"] and c["predictors"]["path"] == pred
    assert c["predictors"]["predicted_share"] == pytest.approx(0.3)
    assert not c["placement"]["in_file"]
    assert [f["path"] for f in c["files"]] == [pred]
    assert cli.main(["info", model]) == 0
    out = capfd.readouterr().out
    assert "predictors (auto): m.predictors.gguf used" in out and "companion file: m.predictors.gguf" in out
    assert cli.main(["info", "--json", model]) == 0
    assert json.loads(capfd.readouterr().out)["companions"]["predictors"]["used"] is True

    # Above the break-even: found and left unused, saying why; a stats file is listed, never used.
    d = tmp_path / "slow"
    d.mkdir()
    os.symlink(smollm2_path, d / "m.gguf")
    above = break_even_share("silu") + 0.1
    fixed_predictor(d / "m.gguf", d / "m.predictors.gguf", active=0.3, recorded_share=above)
    (d / "m.stats.npz").write_bytes(b"")
    c = companions(d / "m.gguf")
    assert c["predictors"]["found"] and not c["predictors"]["used"]
    assert f"{above:.1%}" in c["predictors"]["why"] and "slower than the dense one" in c["predictors"]["why"]
    assert [(os.path.basename(f["path"]), f["used"]) for f in c["files"]] == [("m.predictors.gguf", False),
                                                                               ("m.stats.npz", False)]
    assert cli.main(["info", str(d / "m.gguf")]) == 0
    assert "predictors (auto): m.predictors.gguf found, not used: its predictors mark" in capfd.readouterr().out

    # A predictor file trained for another model: the reason, and that loading with "auto" fails.
    d = tmp_path / "other"
    d.mkdir()
    os.symlink(gemma3_path, d / "m.gguf")
    os.symlink(pred, d / "m.predictors.gguf")
    c = companions(d / "m.gguf")
    assert c["predictors"]["found"] and not c["predictors"]["used"]
    assert "trained for another model" in c["predictors"]["why"]
    with pytest.raises(optiml.PredictorMismatchError):
        optiml.Model(str(d / "m.gguf"), n_ctx=16)


def test_server_metrics_show_sparsity(with_predictors):
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from optiml.server import Server
    from conftest import live_server

    model, pred, skipped = with_predictors
    srv = Server(optiml.Model(model, n_ctx=128, n_seq=2, n_threads=2), n_parallel=2)
    with live_server(srv):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                          "temperature": 0}, timeout=60)
        assert r.status_code == 200
        text = httpx.get(srv.url + "/metrics", timeout=60).text
    assert f'optiml_ffn_sparsity_info{{mode="none",predictors="{pred}"}} 1.0' in text

    def value(name):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        assert m, name
        return float(m.group(1))

    assert value("optiml_ffn_skipped_ratio") == pytest.approx(skipped, abs=1e-9)
    assert value("optiml_ffn_step_skipped_ratio") == pytest.approx(skipped, abs=1e-9)
    seen, skip = value("optiml_ffn_neurons_total"), value("optiml_ffn_neurons_skipped_total")
    assert seen > 0 and skip / seen == pytest.approx(skipped, abs=1e-9)
    assert value("optiml_ffn_step_skipped_count") >= 4  # the prompt and the decode steps


def test_serve_startup_line_names_the_sparsity(with_predictors):
    """optiml serve says what FFN sparsity it runs with, in the line it prints once the model is loaded."""
    pytest.importorskip("uvicorn")

    model, pred, _ = with_predictors
    proc = subprocess.Popen([sys.executable, "-m", "optiml", "serve", "-m", model, "--port", "0", "--ctx", "64",
                             "--parallel", "1", "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env())
    try:
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, line, err)
    assert "FFN: sparsity none (dense), predictors m.predictors.gguf" in r.stdout, r.stdout + r.stderr
