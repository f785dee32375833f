"""`optiml perplexity` as llama.cpp's llama-perplexity: the text read as bytes (CR kept), its output lines, the KLD
report's statistics, bad input refused with exit status 2 (never a traceback, never an input overwritten), the
warning past the training context, and the memory it takes (the scored half's float32 logits, statistics by row
blocks) with results identical to a whole-window float64 computation. A synthetic 2-layer model with SmolLM2's
tokenizer (trained context set to 64), and Gemma 3 for the memory."""

import hashlib
import json
import math
import re
import tracemalloc

import gguf
import numpy as np
import pytest

import optiml
from optiml import cli
from optiml.evaluate import perplexity as px

from conftest import shared_eval_text, tiny_model

N_CTX = 32
N_CTX_TRAIN = 64
LINES = [f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7} times." for i in range(24)]
TEXT = "\n".join(LINES) + "\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("pplcli")
    path = tiny_model(d / "tiny.gguf", **{"llama.context_length": (N_CTX_TRAIN, gguf.GGUFValueType.UINT32)})
    text = d / "t.txt"
    text.write_bytes(TEXT.encode())
    base = d / "base.kld"
    assert cli.main(["-q", "perplexity", "-m", str(path), "-f", str(text), "-c", str(N_CTX), "-t", "2",
                     "--kl-divergence-base", str(base)]) == 0
    return str(path), text, base


def run(capfd, *args):
    """(exit status, stdout, stderr) of `optiml perplexity ARGS`."""
    code = cli.main(["perplexity", *map(str, args)])
    out, err = capfd.readouterr()
    return code, out, err


def reference_nll(m, ws):
    """Per-token -log p of the windows' scored halves as optiml computed them before the row blocks: eval of the
    whole window, then one float64 log-softmax of the half."""
    out = []
    for w in ws:
        m.reset()
        x = m.eval(w, all_logits=True)[N_CTX // 2 : N_CTX - 1].astype(np.float64)
        x = x - x.max(axis=1, keepdims=True)
        logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
        out.append(-logp[np.arange(len(logp)), w[N_CTX // 2 + 1 :]])
    m.reset()
    return np.concatenate(out)


# ---- what it prints ---------------------------------------------------------------------------------
def test_output_lines_are_llama_cpps(tiny, capfd):
    path, text, _ = tiny
    code, out, err = run(capfd, "-m", path, "-f", text, "-c", N_CTX, "-t", 2)
    assert code == 0
    seen = []
    with optiml.Model(path, n_ctx=N_CTX, n_threads=2) as m:
        ppl, ppl_err, _ = px.perplexity(m, TEXT, N_CTX, progress=lambda i, n, x: seen.append((i, x)))
    assert len(seen) >= 3
    # llama.cpp: "Final estimate: PPL = %.4lf +/- %.5lf" and the running perplexity as "[1]x,[2]y," (no spaces).
    assert out == f"Final estimate: PPL = {ppl:.4f} +/- {ppl_err:.5f}\n"
    assert "".join(f"[{i}]{x:.4f}," for i, x in seen) + "\n" in err
    assert re.search(r"^(\[\d+\]\d+\.\d{4},)+$", err, re.M)


def test_text_is_read_as_its_bytes(tiny, tmp_path, capfd):
    """CRLF and lone CR line endings are kept (llama.cpp reads the file's bytes), not turned into LF."""
    path, _, _ = tiny
    ws = {}
    with optiml.Model(path, n_ctx=N_CTX, n_threads=2) as m:
        for name, eol in (("lf", "\n"), ("crlf", "\r\n"), ("cr", "\r")):
            text = eol.join(LINES) + eol
            (tmp_path / f"{name}.txt").write_bytes(text.encode())
            ws[name] = px.windows(m, text, N_CTX)
            base = tmp_path / f"{name}.kld"
            code, _, err = run(capfd, "-q", "-m", path, "-f", tmp_path / f"{name}.txt", "-c", N_CTX, "-t", 2,
                               "--kl-divergence-base", base)
            assert code == 0, err
            b = px.read_base(base)
            assert [b.window(i) for i in range(b.n_chunks)] == ws[name]
    n_tokens = {k: len(v) * N_CTX for k, v in ws.items()}
    assert n_tokens["crlf"] > n_tokens["lf"]  # the \r are tokens of their own
    assert ws["crlf"][0] != ws["lf"][0] and ws["cr"][0] != ws["lf"][0]


def test_warns_past_the_training_context(tiny, capfd):
    path, text, _ = tiny
    code, out, err = run(capfd, "-q", "-m", path, "-f", text, "-c", 2 * N_CTX_TRAIN, "-t", 2)
    assert code == 0 and out.startswith("Final estimate: PPL = ")
    warning = [line for line in err.splitlines() if "warning" in line]  # one line, even with -q
    assert warning == [f"optiml perplexity: warning: the model was trained on only {N_CTX_TRAIN} context tokens, "
                       f"--ctx is {2 * N_CTX_TRAIN}: the windows' positions past {N_CTX_TRAIN} are beyond what it "
                       "learned"]
    code, _, err = run(capfd, "-q", "-m", path, "-f", text, "-c", N_CTX_TRAIN, "-t", 2)
    assert code == 0 and err == ""


# ---- the KLD report -------------------------------------------------------------------------------
def llama_cpp_stats(kld, nll, nll_base):
    """The statistics of llama.cpp's KLD report, from its formulas (tools/perplexity/perplexity.cpp)."""
    n = len(kld)

    def mean_and_uncertainty(s, s2):
        f = s / n
        return f, math.sqrt((s2 / n - f * f) / (n - 1))

    def percentile(values, fraction):
        v = np.sort(values)
        p = fraction * (n - 1)
        i = int(p)
        p -= i
        return (1 - p) * v[i] + p * v[min(i + 1, n - 1)]

    dp = np.exp(-nll) - np.exp(-nll_base)
    out = {"kld_max": kld.max(), "kld_min": kld.min(), "kld_p50": np.median(kld),
           "delta_p_max": dp.max(), "delta_p_min": dp.min(), "delta_p_p50": np.median(dp)}
    for q in (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1):
        out[f"kld_p{q:g}"] = percentile(kld, q / 100)
    for q in (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1):
        out[f"delta_p_p{q:g}"] = percentile(dp, q / 100)
    out["kld_mean"], out["kld_err"] = mean_and_uncertainty(kld.sum(), (kld * kld).sum())
    out["delta_p_mean"], out["delta_p_mean_err"] = mean_and_uncertainty(dp.sum(), (dp * dp).sum())
    mse, mse_err = mean_and_uncertainty((dp ** 2).sum(), (dp ** 4).sum())
    out["delta_p_rms"], out["delta_p_rms_err"] = math.sqrt(mse), 0.5 / math.sqrt(mse) * mse_err
    return out


def test_kld_summary_is_llama_cpps():
    rng = np.random.default_rng(0)
    n = 1000
    kld = rng.gamma(0.5, 0.01, n)
    nll_base = rng.gamma(2.0, 1.5, n)
    nll = nll_base + rng.normal(0, 0.2, n)
    r = px.KLDResult(kld, rng.random(n) < 0.9, nll, nll_base)
    s = r.summary()
    for k, v in llama_cpp_stats(kld, nll, nll_base).items():
        assert s[k] == pytest.approx(v, rel=1e-9, abs=1e-15), k
    lines = r.format().splitlines()
    i = lines.index("====== Token probability statistics ======")
    assert lines[i + 1] == f"Mean    Δp: {100 * s['delta_p_mean']:6.3f} ± {100 * s['delta_p_mean_err']:5.3f} %"
    assert lines[i + 2] == f"Maximum Δp: {100 * s['delta_p_max']:6.3f}%"
    assert lines[i + 3] == f"99.9%   Δp: {100 * s['delta_p_p99.9']:6.3f}%"
    assert lines[i + 7] == f"75.0%   Δp: {100 * s['delta_p_p75']:6.3f}%"
    assert lines[i + 8] == f"Median  Δp: {100 * s['delta_p_p50']:6.3f}%"
    assert lines[i + 9] == f"25.0%   Δp: {100 * s['delta_p_p25']:6.3f}%"
    assert lines[i + 13] == f" 0.1%   Δp: {100 * s['delta_p_p0.1']:6.3f}%"
    assert lines[i + 14] == f"Minimum Δp: {100 * s['delta_p_min']:6.3f}%"
    assert lines[i + 15] == f"RMS Δp    : {100 * s['delta_p_rms']:6.3f} ± {100 * s['delta_p_rms_err']:5.3f} %"
    assert lines[i + 16] == f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_err']:5.3f} %"
    j = lines.index("====== KL divergence statistics ======")
    assert lines[j + 2] == f"Maximum KLD: {s['kld_max']:10.6f}"
    assert lines[j + 11] == f" 0.1%   KLD: {s['kld_p0.1']:10.6f}"
    assert lines[j + 12] == f"Minimum KLD: {s['kld_min']:10.6f}"


def test_cli_compares_with_the_report(tiny, capfd):
    """A 4-bit KV cache against the base's f16 one: the report, and --json, of compare()'s per-token values."""
    path, text, base = tiny
    code, out, err = run(capfd, "-m", path, "-t", 2, "--kl-divergence-base", base, "--kl-divergence",
                         "-ctk", "q4_0", "-ctv", "q4_0")
    assert code == 0, err
    with optiml.Model(path, n_ctx=N_CTX, n_threads=2, kv_type="q4_0") as m:
        r = px.compare(base, m)
    assert r.kld.mean() > 0
    assert out.endswith(r.format() + "\n")
    code, out, _ = run(capfd, "-q", "-m", path, "-t", 2, "--kl-divergence-base", base, "--kl-divergence",
                       "-ctk", "q4_0", "-ctv", "q4_0", "--json", "--chunks", 1)
    s = json.loads(out)
    assert s["n_tokens"] == N_CTX // 2 - 1
    for k, v in llama_cpp_stats(r.kld[: s["n_tokens"]], r.nll[: s["n_tokens"]], r.nll_base[: s["n_tokens"]]).items():
        assert s[k] == pytest.approx(v, rel=1e-9, abs=1e-15), k


# ---- bad input: exit 2, the file and the fix named, nothing overwritten -----------------------------
def test_a_base_never_overwrites_an_input(tiny, tmp_path, capfd):
    path, text, _ = tiny
    for victim in (str(text), path):
        digest = hashlib.sha256(open(victim, "rb").read()).hexdigest()
        code, _, err = run(capfd, "-m", path, "-f", text, "-c", N_CTX, "--kl-divergence-base", victim)
        assert code == 2 and "is an input file" in err and "Traceback" not in err
        assert hashlib.sha256(open(victim, "rb").read()).hexdigest() == digest
    code, _, err = run(capfd, "-m", path, "-f", text, "-c", N_CTX, "--kl-divergence-base", tmp_path / "no" / "b.kld")
    assert code == 2 and "output folder does not exist" in err


def test_bad_flags(tiny, tmp_path, capfd):
    path, text, base = tiny
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.")
    for args, said in ((("-f", text, "--chunks", 0), "--chunks"),
                       (("-f", text, "--chunks", -5), "--chunks"),
                       (("--kl-divergence-base", base, "--kl-divergence", "--chunks", 0), "--chunks"),
                       (("--kl-divergence-base", base, "--kl-divergence", "--chunks", -5), "--chunks"),
                       (("--kl-divergence-base", base, "--kl-divergence", "--kl-top-k", 8), "leave --kl-top-k out"),
                       (("-f", text, "--kl-top-k", 8), "--kl-divergence-base FILE saves"),
                       (("--kl-divergence-base", base, "--kl-divergence", "-f", short), "leave -f out")):
        code, out, err = run(capfd, "-m", path, "-t", 2, *args)
        assert code == 2 and said in err and "Traceback" not in err and out == "", (args, err)
        assert "smaller --ctx" not in err
    with optiml.Model(path, n_ctx=N_CTX, n_threads=2) as m:
        with pytest.raises(optiml.ArgumentError, match="--chunks"):
            px.compare(base, m, 0)
        assert px.compare(base, m, -1).n == px.compare(base, m).n == px.read_base(base).n_chunks * (N_CTX // 2 - 1)


def write_base(path, header: dict, n_records=None, magic=px.MAGIC):
    """A base file with this header, tokens 0 and zero records (as many as the header promises, or n_records)."""
    h = json.dumps(header).encode()
    n_ctx, n_chunks = header.get("n_ctx", 8), header.get("n_chunks", 1)
    body = magic + np.array([px.VERSION, len(h)], "<u4").tobytes() + h + bytes(4 * n_ctx * n_chunks)
    body += bytes(-len(body) % 64)
    if n_records is None:
        n_records = n_chunks * (n_ctx - 1 - n_ctx // 2)
    dt = px.record_dtype(header.get("n_vocab", 300), header.get("top_k", 0))
    path.write_bytes(body + np.zeros(n_records, dt).tobytes())
    return path


def test_bad_bases_are_bad_input(tiny, tmp_path, capfd):
    path, _, _ = tiny
    good = {"n_vocab": 300, "n_ctx": 8, "n_chunks": 1, "first": 4, "top_k": 0, "logp_step": px.LOGP_STEP}
    broken = tmp_path / "broken.kld"
    broken.write_bytes(px.MAGIC + np.array([px.VERSION, 9], "<u4").tobytes() + b"{not json")
    cases = [(broken, "header is not valid JSON"),
             (write_base(tmp_path / "lacks.kld", {k: v for k, v in good.items() if k != "top_k"}), "lacks top_k"),
             (write_base(tmp_path / "values.kld", {**good, "first": 3}), "bad values (first=3)"),
             (write_base(tmp_path / "cut.kld", good, n_records=2), "truncated"),
             (write_base(tmp_path / "llama.kld", good, magic=px.LLAMA_CPP_MAGIC), "a llama.cpp base"),
             # a whole base, of another vocabulary: refused before the model runs a window
             (write_base(tmp_path / "vocab.kld", good), "same tokenizer")]
    for f, said in cases:
        code, out, err = run(capfd, "-m", path, "-t", 2, "--kl-divergence-base", f, "--kl-divergence")
        assert code == 2 and said in err and str(f) in err and "[1]" not in err, (f, err)
        assert "Traceback" not in err and out == ""
    code, _, err = run(capfd, "-m", path, "--kl-divergence-base", tmp_path / "llama.kld", "--kl-divergence")
    assert "optiml does not read" in err and "optiml perplexity -m BASE_MODEL -f TEXT --kl-divergence-base FILE" in err


# ---- memory and exactness -------------------------------------------------------------------------
def test_blocks_give_todays_results_exactly(tiny, tmp_path, monkeypatch):
    """Row blocks of 3 (5 per window) give bit for bit the per-token values of one float64 log-softmax of the
    whole scored half (the code before the blocks)."""
    path, _, _ = tiny
    with optiml.Model(path, n_ctx=N_CTX, n_threads=2) as m:
        monkeypatch.setattr(px, "BLOCK_VALUES", 3 * m.n_vocab)
        ws = px.windows(m, TEXT, N_CTX)
        nll = reference_nll(m, ws)
        ppl, err, count = px.perplexity(m, TEXT, N_CTX)
        assert count == len(nll) and (ppl, err) == px._ppl(nll)
        base = tmp_path / "b.kld"
        px.save_base(base, m, TEXT, N_CTX)
        rec = np.asarray(px.read_base(base).records).reshape(-1)
        np.testing.assert_array_equal(-rec["target_logp"], nll.astype(np.float32))
    with optiml.Model(path, n_ctx=N_CTX, n_threads=2, kv_type="q4_0") as q:
        r = px.compare(base, q)
        want = []
        for i, w in enumerate(ws):  # the comparison of whole halves
            q.reset()
            logp = px.log_softmax(q.eval(w, all_logits=True)[N_CTX // 2 : N_CTX - 1])
            want.append(px.token_stats(px.decode_full(np.asarray(px.read_base(base).records[i])), logp,
                                       np.asarray(w[N_CTX // 2 + 1 :]))["kld"])
        np.testing.assert_array_equal(r.kld, np.concatenate(want))
        np.testing.assert_array_equal(r.nll, reference_nll(q, ws))


def test_memory_is_the_scored_half(gemma3_path, tmp_path):
    """Gemma 3 (262144 entries) at n_ctx 512: the Python side's peak stays within a few row blocks, where one
    float64 log-softmax of the scored half (255 rows, 510 MiB, and its temporaries) took over 1 GiB."""
    text = shared_eval_text()
    bound = 5 * px.BLOCK_VALUES * 8  # 160 MiB: a block's float64 temporaries
    with optiml.Model(gemma3_path, n_ctx=512, n_threads=2) as m:
        for what, job in (("perplexity", lambda: px.perplexity(m, text, 512, 1)),
                          ("save_base", lambda: px.save_base(tmp_path / "g.kld", m, text, 512, 1)),
                          ("compare", lambda: px.compare(tmp_path / "g.kld", m))):
            tracemalloc.start()
            try:
                job()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < bound, (what, peak / 2**20)
