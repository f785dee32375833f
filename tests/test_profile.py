"""optiml profile: the recorder's statistics against independent references (gguf-py's dequantized
weights, float64 numpy FFNs on the recorded inputs), the activation skew of SmolLM2, and bad input."""

import json

import gguf
import numpy as np
import pytest

import optiml
from optiml.formats import stats as stats_mod
from optiml.offline.profile import coverage_of_top, layer_quantiles, read_texts
from optiml.offline.profile import profile as run_profile

from conftest import shared_eval_text


@pytest.fixture(scope="module")
def smol_stats(smollm2_path):
    return run_profile(str(smollm2_path), None, texts=[shared_eval_text()], n_tokens=1024, samples=16,
                       n_ctx=256, progress=False)


def test_skew_of_smollm2(smol_stats):
    st = smol_stats
    assert st.n_tokens == 1024 and st.freq.shape == (30, 1536)
    top10, top20 = coverage_of_top(st, 0.1), coverage_of_top(st, 0.2)
    print(f"\nSmolLM2 on the shared eval text: top 10% of neurons cover {top10:.1%} of firings, top 20% {top20:.1%}")
    # SwiGLU activations are skewed but far from ReLU's power law: clearly more than the neurons' share.
    assert top10 > 0.12 and top20 > 0.23
    # The per-layer thresholds were set so that about half of the activations fire.
    assert 0.4 < float(st.freq.mean()) < 0.6


def test_down_norm_and_impact_match_gguf_py(smol_stats, smollm2_path):
    r = gguf.GGUFReader(str(smollm2_path))
    t = next(t for t in r.tensors if t.name == "blk.3.ffn_down.weight")
    down = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)  # [n_embd, n_ff]
    np.testing.assert_allclose(smol_stats.down_norm[3], np.linalg.norm(down, axis=0), rtol=1e-5)
    np.testing.assert_allclose(smol_stats.impact, smol_stats.mean_abs * smol_stats.down_norm, rtol=1e-6)


def test_samples_match_a_float64_ffn(smol_stats, smollm2_path):
    """The sampled FFN inputs, run through numpy's float64 FFN with gguf-py's weights, fire where the
    recorder said (except within the 8-bit activation rounding of the threshold)."""
    st = smol_stats
    assert st.sample_x.shape == (30, 16, 576) and st.sample_mask.shape == (30, 16, 1536 // 8)
    r = gguf.GGUFReader(str(smollm2_path))
    w = {t.name: t for t in r.tensors}
    agree = total = 0
    for layer in (0, 15, 29):
        gate = gguf.quants.dequantize(w[f"blk.{layer}.ffn_gate.weight"].data, w[f"blk.{layer}.ffn_gate.weight"].tensor_type)
        up = gguf.quants.dequantize(w[f"blk.{layer}.ffn_up.weight"].data, w[f"blk.{layer}.ffn_up.weight"].tensor_type)
        x = st.sample_x[layer].astype(np.float64)
        g, u = x @ gate.T.astype(np.float64), x @ up.T.astype(np.float64)
        h = g / (1 + np.exp(-g)) * u
        fired = np.unpackbits(st.sample_mask[layer], axis=1)[:, :1536].astype(bool)
        ref = np.abs(h) > st.threshold[layer]
        near = np.abs(np.abs(h) - st.threshold[layer]) < 0.05 * st.threshold[layer] + 1e-3
        agree += int(np.sum((fired == ref) | near))
        total += h.size
    assert agree / total > 0.995


def test_histograms_count_every_activation(smol_stats):
    st = smol_stats
    n = st.n_tokens * st.n_ff
    np.testing.assert_allclose(st.gate_hist.sum(axis=1), n)
    np.testing.assert_allclose(st.prod_hist.sum(axis=1), n)
    # The share above each layer's threshold, read back from the histogram, is the firing rate.
    q = layer_quantiles(st.prod_hist, st.hist_edges, 1.0 - st.freq.mean(axis=1))
    np.testing.assert_allclose(q, st.threshold, rtol=0.1)


def test_save_load_and_model_check(smol_stats, smollm2_path, gemma3_path, tmp_path):
    p = tmp_path / "s.npz"
    stats_mod.save(smol_stats, p)
    back = stats_mod.load(p)
    np.testing.assert_array_equal(back.freq, smol_stats.freq)
    np.testing.assert_array_equal(back.sample_mask, smol_stats.sample_mask)
    assert back.n_tokens == 1024 and back.activation == "silu"
    back.check_model(smollm2_path)
    with pytest.raises(optiml.ArgumentError, match="optiml profile"):
        back.check_model(gemma3_path)
    bad = tmp_path / "bad.npz"
    np.savez(bad, freq=np.zeros((2, 2)))
    with pytest.raises(optiml.ArgumentError, match="missing"):
        stats_mod.load(bad)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(optiml.ArgumentError, match="not an activation stats file"):
        stats_mod.load(tmp_path / "junk.npz")


def test_read_texts_plain_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    (tmp_path / "d.jsonl").write_text("{not json\n")
    assert read_texts([tmp_path / "a.txt", tmp_path / "b.jsonl"]) == ["hello world", "one", "two"]
    assert read_texts([tmp_path / "c.jsonl"], field="body") == ["x"]
    with pytest.raises(optiml.ArgumentError, match="field 'text'"):
        read_texts([tmp_path / "c.jsonl"])
    with pytest.raises(optiml.ArgumentError, match="not a JSON line"):
        read_texts([tmp_path / "d.jsonl"])
    with pytest.raises(FileNotFoundError):
        read_texts([tmp_path / "missing.txt"])
    with pytest.raises(optiml.ArgumentError, match="is a folder: give text or JSONL files"):  # not "not found"
        read_texts([tmp_path])


def test_bad_arguments(smollm2_path, tmp_path):
    for kw, msg in [({"n_tokens": 0}, "n_tokens"), ({"samples": -1}, "samples"), ({"threshold": -1.0}, "threshold"),
                    ({"active_share": 1.5}, "active_share"), ({"out": tmp_path / "no" / "s.npz"}, "folder")]:
        with pytest.raises(optiml.ArgumentError, match=msg):
            run_profile(str(smollm2_path), None, texts=["some text"], progress=False, **kw)


def test_cli_profile_writes_stats(smollm2_path, tmp_path, capsys):
    from optiml.cli import main

    data = tmp_path / "d.txt"
    data.write_text(shared_eval_text()[:4000])
    out = tmp_path / "s.npz"
    assert main(["profile", "-m", str(smollm2_path), "--data", str(data), "--tokens", "300", "-q", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "top 10%" in text and "wrote" in text
    assert stats_mod.load(out).n_tokens == 300
    # the text runs out before --tokens: a log line says how many were profiled (it was quiet about it)
    short = tmp_path / "short.txt"
    short.write_text("The quick brown fox jumps over the lazy dog.")
    assert main(["profile", "-m", str(smollm2_path), "--data", str(short), "-t", "1", "-o", str(out)]) == 0
    n = stats_mod.load(out).n_tokens
    assert 0 < n < 20000
    assert f"the data has {n} tokens, fewer than --tokens 20000: profiled all {n}" in capsys.readouterr().err
    assert main(["profile", "-m", str(smollm2_path), "--data", str(tmp_path), "-q", "-o", str(out)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_offline_commands_refuse_an_input_as_their_output(smollm2_path, tmp_path, capsys):
    """profile, calibrate and train-predictors refuse to write over the model, the text or the stats they
    read (they overwrote them and said "wrote"), and a folder as the output, before any work; each input is
    left as it was."""
    from optiml.cli import main

    data = tmp_path / "d.txt"
    data.write_text(shared_eval_text()[:2000])
    model = tmp_path / "m.gguf"
    model.symlink_to(smollm2_path)
    stats = tmp_path / "s.npz"
    stats.write_bytes(b"not yet")
    before = {p: p.read_bytes() for p in (data, stats)}
    cases = [
        ["profile", "-m", str(model), "--data", str(data), "-o", str(model)],
        ["profile", "-m", str(model), "--data", str(data), "-o", str(data)],
        ["calibrate", "-m", str(model), "--data", str(data), "-o", str(data)],
        ["calibrate", "-m", str(model), "--stats", str(stats), "-o", str(stats)],
        ["train-predictors", "-m", str(model), "--data", str(data), "-o", str(data)],
    ]
    for argv in cases:
        assert main(["-q", *argv]) == 2, argv
        assert "is an input file" in capsys.readouterr().err, argv
    assert main(["-q", "train-predictors", "-m", str(model), "--data", str(data), "-o", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (data, stats)} == before and model.resolve() == smollm2_path.resolve()
    # calibrate takes its tokens from --stats or from --data, not both; profile's chunks are at least a token
    assert main(["-q", "calibrate", "-m", str(model), "--stats", str(stats), "--data", str(data), "-o",
                 str(tmp_path / "c.gguf")]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["-q", "profile", "-m", str(model), "--data", str(data), "--ctx", "0", "-o", str(tmp_path / "p.npz")]) == 2
    assert "n_ctx must be a positive integer" in capsys.readouterr().err
