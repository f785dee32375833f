"""optiml.perplexity and `optiml perplexity --kl-divergence-base/--kl-divergence` on tiny converted
models (a float32 base and its Q4_0 conversion), checked against numpy float64 computations on the
models' raw logits."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import optiml  # noqa: E402
from optiml import cli  # noqa: E402
from optiml.evaluate import perplexity as px  # noqa: E402
from optiml.convert import convert  # noqa: E402

from test_convert import save_folder, tiny_tokenizer  # noqa: E402,F401  (a module fixture)
from test_model_hf import BASE  # noqa: E402

N_CTX = 32
TEXT = " ".join(f"The capital of France is Paris, {i} and more words here {i * 7}." for i in range(12))


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer):  # noqa: F811
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**BASE, "num_key_value_heads": 2, "hidden_size": 128, "intermediate_size": 256})
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the init's: sharper distributions, a visible KLD
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(4.0)
    d = tmp_path_factory.mktemp("ppl")
    folder = save_folder(model, d / "hf", tiny_tokenizer)
    return convert(folder, d / "base.gguf", type="f32"), convert(folder, d / "q4_0.gguf", type="q4_0")


def raw_windows(m):
    """The windows, independently: tokens cut in n_ctx pieces, BOS in front when the model adds it."""
    toks = m.tokenize(TEXT, add_bos=True)
    ws = [toks[i * N_CTX : (i + 1) * N_CTX] for i in range(len(toks) // N_CTX)]
    if m.tokenizer.add_bos:
        for w in ws:
            w[0] = m.tokenizer.bos_id
    return ws


def raw_scored(path):
    """float64 log-probs of every window's second half and their targets, straight from eval."""
    with optiml.Model(path, n_ctx=N_CTX, n_threads=2) as m:
        ws = raw_windows(m)
        rows, targets = [], []
        for w in ws:
            m.reset()
            x = m.eval(w, all_logits=True).astype(np.float64)[N_CTX // 2 : N_CTX - 1]
            x -= x.max(axis=1, keepdims=True)
            rows.append(x - np.log(np.exp(x).sum(axis=1, keepdims=True)))
            targets.append(w[N_CTX // 2 + 1 :])
    return ws, np.concatenate(rows), np.concatenate(targets)


def test_perplexity_equals_numpy(models):
    base, _ = models
    ws, logp, targets = raw_scored(base)
    assert len(ws) >= 3
    nll = -logp[np.arange(len(targets)), targets]
    with optiml.Model(base, n_ctx=N_CTX, n_threads=2) as m:
        ppl, err, count = px.perplexity(m, TEXT, N_CTX)
    assert count == len(ws) * (N_CTX // 2 - 1) == len(nll)
    assert ppl == pytest.approx(math.exp(nll.mean()), rel=1e-9)
    assert err == pytest.approx(nll.std() / math.sqrt(len(nll) - 1) * ppl, rel=1e-6)


@pytest.mark.parametrize("top_k", [0, 8])
def test_base_file_round_trip(models, tmp_path, top_k):
    base, _ = models
    ws, logp, targets = raw_scored(base)
    f = tmp_path / "base.kld"
    with optiml.Model(base, n_ctx=N_CTX, n_threads=2) as m:
        ppl, _, count = px.save_base(f, m, TEXT, N_CTX, top_k=top_k)
        n_vocab = m.n_vocab
    b = px.read_base(f)
    assert (b.n_ctx, b.n_chunks, b.n_vocab, b.top_k, b.model) == (N_CTX, len(ws), n_vocab, top_k, "base.gguf")
    assert [b.window(i) for i in range(b.n_chunks)] == ws
    rec = np.asarray(b.records).reshape(-1)
    assert len(rec) == count
    np.testing.assert_allclose(rec["target_logp"], logp[np.arange(count), targets], rtol=1e-6, atol=1e-6)
    assert ppl == pytest.approx(math.exp(-logp[np.arange(count), targets].mean()), rel=1e-6)
    if top_k == 0:  # the full distribution, within half a quantization step (+ the renormalization)
        assert np.abs(px.decode_full(rec) - logp).max() <= px.LOGP_STEP
    else:
        want = np.argsort(-logp, axis=1)[:, :top_k]
        np.testing.assert_array_equal(rec["ids"], want)
        np.testing.assert_allclose(rec["logp"], np.take_along_axis(logp, want, 1), rtol=1e-6)
        rest = 1 - np.exp(np.take_along_axis(logp, want, 1)).sum(axis=1)
        np.testing.assert_allclose(np.exp(rec["tail_logp"].astype(np.float64)), rest, rtol=1e-4)
    # A file that is cut short or is something else is refused with a message.
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(optiml.ArgumentError, match="truncated"):  # bad input: exit status 2
        px.read_base(f)
    f.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(optiml.ArgumentError, match="not an optiml KL-divergence base"):
        px.read_base(f)


def numpy_kld(p, q):
    return (np.exp(p) * (p - q)).sum(axis=1)


def test_compare_equals_numpy_full_and_top_k(models, tmp_path):
    base, other = models
    _, bp, targets = raw_scored(base)
    _, qp, _ = raw_scored(other)
    kld = numpy_kld(bp, qp)
    assert kld.mean() > 1e-3  # Q4_0 is visibly off the f32 model: a test with something to measure
    for top_k in (0, 8):
        with optiml.Model(base, n_ctx=N_CTX, n_threads=2) as m:
            px.save_base(tmp_path / f"b{top_k}.kld", m, TEXT, N_CTX, top_k=top_k)
        with optiml.Model(other, n_ctx=N_CTX, n_threads=2) as m:
            r = px.compare(tmp_path / f"b{top_k}.kld", m)
        if top_k == 0:
            # Base log-probs are stored within eps = one quantization step: the KLD moves by at most
            # about eps * (1 + sum p |log p - log q|) per token.
            bound = 2 * px.LOGP_STEP * (1 + (np.exp(bp) * np.abs(bp - qp)).sum(axis=1))
            assert np.all(np.abs(r.kld - kld) <= bound)
            assert abs(r.kld.mean() - kld.mean()) <= 1e-3 * kld.mean()
            want = r.kld  # the summary below is of these per-token values
        else:  # the top 8 of the base, the rest as one outcome: a lower bound of the full KLD
            idx = np.argsort(-bp, axis=1)[:, :top_k]
            p, q = np.take_along_axis(bp, idx, 1), np.take_along_axis(qp, idx, 1)
            pt, qt = 1 - np.exp(p).sum(axis=1), 1 - np.exp(q).sum(axis=1)
            want = (np.exp(p) * (p - q)).sum(axis=1) + pt * np.log(pt / qt)
            np.testing.assert_allclose(r.kld, want, rtol=1e-4, atol=1e-6)
            assert r.kld.mean() <= kld.mean()
            want = r.kld  # the summary below is of these (a percentile of the bound above moved by 1.1e-6)
        np.testing.assert_array_equal(r.same_top, bp.argmax(1) == qp.argmax(1))
        rows = np.arange(len(targets))
        nll, nll_base = -qp[rows, targets], -bp[rows, targets]
        np.testing.assert_allclose(r.nll, nll, rtol=1e-9)
        np.testing.assert_allclose(r.nll_base, nll_base, rtol=1e-6)
        s = r.summary()
        assert s["n_tokens"] == len(targets)
        assert s["kld_mean"] == pytest.approx(want.mean(), rel=1e-6)
        for q in (50, 90, 95, 99):
            assert s[f"kld_p{q}"] == pytest.approx(np.percentile(want, q), rel=1e-6, abs=1e-9)
        assert s["kld_max"] == pytest.approx(want.max(), rel=1e-6)
        assert s["same_top"] == pytest.approx((bp.argmax(1) == qp.argmax(1)).mean())
        ppl, ppl_base = math.exp(nll.mean()), math.exp(nll_base.mean())
        assert s["ppl"] == pytest.approx(ppl, rel=1e-9) and s["ppl_base"] == pytest.approx(ppl_base, rel=1e-6)
        assert s["delta_ppl"] == pytest.approx(ppl - ppl_base, rel=1e-5)
        assert s["ln_ppl_ratio"] == pytest.approx((nll - nll_base).mean(), rel=1e-5)


def test_a_model_against_its_own_base(models, tmp_path):
    base, _ = models
    with optiml.Model(base, n_ctx=N_CTX, n_threads=2) as m:
        px.save_base(tmp_path / "b.kld", m, TEXT, N_CTX)
        s = px.compare(tmp_path / "b.kld", m).summary()
    assert abs(s["kld_mean"]) < 1e-6 and s["kld_max"] < 1e-5
    assert s["same_top"] == 1.0 and abs(s["delta_ppl"]) < 1e-4 * s["ppl"]


def test_cli_saves_and_compares(models, tmp_path, capsys):
    base, other = models
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    f = str(tmp_path / "base.kld")
    assert cli.main(["perplexity", "-m", str(base), "-f", str(text), "--ctx", str(N_CTX), "-t", "2",
                     "--kl-divergence-base", f]) == 0
    out = capsys.readouterr().out
    with optiml.Model(base, n_ctx=N_CTX, n_threads=2) as m:
        ppl, err, _ = px.perplexity(m, TEXT, N_CTX)
    assert out == f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}\n"  # llama.cpp's line
    assert cli.main(["perplexity", "-m", str(other), "-t", "2", "--kl-divergence-base", f, "--kl-divergence"]) == 0
    out = capsys.readouterr().out
    with optiml.Model(other, n_ctx=N_CTX, n_threads=2) as m:
        want = px.compare(f, m)
    assert out.strip().endswith(want.format())
    assert f"Mean    KLD: {want.summary()['kld_mean']:10.6f}" in out and "Same top p:" in out
    assert "Median  KLD:" in out and "99.0%   KLD:" in out and "Mean PPL(Q)-PPL(base)" in out
    # The text, when given, must tokenize to the stored windows; --ctx must match the base's.
    assert cli.main(["perplexity", "-m", str(other), "-f", str(text), "--kl-divergence-base", f,
                     "--kl-divergence"]) == 0
    capsys.readouterr()
    (tmp_path / "other.txt").write_text(TEXT[::-1])
    assert cli.main(["perplexity", "-m", str(other), "-f", str(tmp_path / "other.txt"), "--kl-divergence-base", f,
                     "--kl-divergence"]) == 2  # bad input
    assert "does not tokenize to the base's tokens" in capsys.readouterr().err
    assert cli.main(["perplexity", "-m", str(other), "--ctx", "64", "--kl-divergence-base", f, "--kl-divergence"]) == 2
    assert f"--ctx {N_CTX}" in capsys.readouterr().err
    assert cli.main(["perplexity", "-m", str(other), "--kl-divergence"]) == 2
    assert "--kl-divergence-base FILE" in capsys.readouterr().err


def test_vocab_mismatch_is_refused(models, tmp_path, smollm2_path):
    base, _ = models
    with optiml.Model(base, n_ctx=N_CTX, n_threads=2) as m:
        px.save_base(tmp_path / "b.kld", m, TEXT, N_CTX, n_chunks=1)
    with optiml.Model(smollm2_path, n_ctx=N_CTX, n_threads=2) as m:
        with pytest.raises(optiml.ArgumentError, match="same tokenizer"):
            px.compare(tmp_path / "b.kld", m)
