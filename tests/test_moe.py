"""Mixture-of-experts models (issue #46, the CPU half): qwen3moe, qwen2moe (shared expert), llama with
experts (Mixtral) and gpt-oss (biased router and experts, a clamped SwiGLU, attention sinks, sliding-window
layers, YaRN), on tiny synthetic files written by tools/make_synthetic_model.py.

Two oracles, both independent of OptiML: a float64 numpy forward pass written here from the models'
definitions (router softmax, top k, renormalized or not, the shared expert's sigmoid gate), reading the
file's weights dequantized by gguf-py; and llama.cpp (llama-cpp-python) on the same file. We must be as
close to the float64 pass as llama.cpp is (KLD within 10%, plus a floor far below anything routing
could cause), and agree with llama.cpp's greedy tokens wherever neither engine is at a near-tie.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import optiml
from optiml.evaluate import perplexity as px

sys.path.insert(0, str(Path(__file__).parent))
from fidelity import TIE, top2_gap  # noqa: E402

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

ROOT = Path(__file__).resolve().parent.parent
IDS = [(i * 7919) % 40000 + 300 for i in range(40)]  # token ids spread over the vocabulary


def synthetic(path, *args):
    cmd = [sys.executable, str(ROOT / "tools" / "make_synthetic_model.py"), "-o", str(path), "--quiet", *args]
    subprocess.run(cmd, check=True, capture_output=True)
    return path


TINY = ["--n-embd", "64", "--n-layer", "2", "--n-head", "4", "--n-head-kv", "2", "--std", "0.1"]
ARCHS = {
    # 8 experts of 64, 2 used, per-head q/k norms, renormalized weights
    "qwen3moe": ["--arch", "qwen3moe", "--n-ff", "128", "--experts", "8", "--experts-used", "2", "--n-ff-exp", "64"],
    # a shared expert of 96 with its sigmoid gate, q/k/v biases, weights not renormalized
    "qwen2moe": ["--arch", "qwen2moe", "--n-ff", "128", "--experts", "8", "--experts-used", "3", "--n-ff-exp", "32",
                 "--shared-expert", "96"],
    # Mixtral: llama with 4 experts of n_ff, 2 used, normal RoPE
    "mixtral": ["--arch", "llama", "--n-ff", "64", "--experts", "4", "--experts-used", "2"],
    # gpt-oss: 8 experts of 64, 2 used; a window of 8 positions on layer 0 (the prompts are 12-40 long)
    "gpt-oss": ["--arch", "gpt-oss", "--n-ff", "128", "--experts", "8", "--experts-used", "2", "--n-ff-exp", "64",
                "--sliding-window", "8"],
}


@pytest.fixture(scope="module", params=list(ARCHS))
def f32_model(request, tmp_path_factory):
    name = request.param
    return name, synthetic(tmp_path_factory.mktemp("moe") / f"{name}.gguf", *TINY, *ARCHS[name], "--type", "f32")


# ---- the float64 reference ---------------------------------------------------------------------


class Reference:
    """The forward pass of a GGUF llama/qwen2moe/qwen3moe model in float64, from its definition."""

    def __init__(self, path):
        r = gguf.GGUFReader(str(path))
        field = lambda k: r.fields[k].contents()  # noqa: E731
        self.arch = arch = field("general.architecture")
        g = lambda k, d=None: field(f"{arch}.{k}") if f"{arch}.{k}" in r.fields else d  # noqa: E731
        self.n_layer, self.n_head, self.n_head_kv = g("block_count"), g("attention.head_count"), g("attention.head_count_kv")
        self.eps, self.base = g("attention.layer_norm_rms_epsilon"), g("rope.freq_base", 10000.0)
        self.n_expert, self.k = g("expert_count"), g("expert_used_count")
        self.norm_w = arch not in ("qwen2moe", "gpt-oss")
        self.neox = arch != "llama"
        self.oss = arch == "gpt-oss"  # YaRN over the original context, sinks, a window on even layers
        self.swa, self.factor, self.orig = g("attention.sliding_window"), g("rope.scaling.factor"), \
            g("rope.scaling.original_context_length")
        self.t = {}
        for t in r.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            self.t[t.name] = np.asarray(data, dtype=np.float64).reshape(shape)
        self.head_dim = self.t["blk.0.attn_q.weight"].shape[0] // self.n_head

    def rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):  # x [n, heads, hd]
        hd = x.shape[-1]
        inv = self.base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = pos[:, None, None] * inv[None, None, :]
        c, s = np.cos(ang), np.sin(ang)
        if self.oss:  # YaRN (arXiv 2309.00071) with ggml's correction range: whole dimensions, floor and ceil
            corr = lambda turns: hd * np.log(self.orig / (turns * 2 * np.pi)) / (2 * np.log(self.base))  # noqa: E731
            low, high = max(0, np.floor(corr(32))), min(hd - 1, np.ceil(corr(1)))
            ramp = 1 - np.clip((np.arange(hd // 2) - low) / max(0.001, high - low), 0, 1)
            ang = ang / self.factor * (1 - ramp) + ang * ramp
            m = 1 + 0.1 * np.log(self.factor)
            c, s = np.cos(ang) * m, np.sin(ang) * m
        if self.neox:
            a, b = x[..., : hd // 2], x[..., hd // 2 :]
            return np.concatenate([a * c - b * s, a * s + b * c], -1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    def moe(self, p, h):
        T = self.t
        bias = lambda name, e=slice(None): T[p + name][e] if p + name in T else 0.0  # noqa: E731 (gpt-oss)
        logits = h @ T[p + "ffn_gate_inp.weight"].T + bias("ffn_gate_inp.bias")
        top = np.sort(logits, -1)
        self.route_gap = min(self.route_gap, float((top[:, -self.k] - top[:, -self.k - 1]).min()))
        prob = np.exp(logits - logits.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        y = np.zeros_like(h)
        for i in range(len(h)):
            top = np.argsort(-prob[i], kind="stable")[: self.k]
            w = prob[i, top]
            if self.norm_w or self.oss:  # (gpt-oss: the softmax of the chosen logits, the same thing)
                w = w / w.sum()
            self.choices.setdefault(p, []).append((top, w, []))  # per token: experts, weights, their act*up
            for e, we in zip(top, w):
                g = T[p + "ffn_gate_exps.weight"][e] @ h[i] + bias("ffn_gate_exps.bias", e)
                u = T[p + "ffn_up_exps.weight"][e] @ h[i] + bias("ffn_up_exps.bias", e)
                if self.oss:  # the clamped SwiGLU: alpha 1.702, limit 7
                    g = np.minimum(g, 7.0)
                    act = g / (1 + np.exp(-1.702 * g)) * (np.clip(u, -7.0, 7.0) + 1)
                else:
                    act = g / (1 + np.exp(-g)) * u
                self.choices[p][-1][2].append(act)
                y[i] += we * (T[p + "ffn_down_exps.weight"][e] @ act + bias("ffn_down_exps.bias", e))
        if p + "ffn_gate_shexp.weight" in T:
            g, u = h @ T[p + "ffn_gate_shexp.weight"].T, h @ T[p + "ffn_up_shexp.weight"].T
            s = (g / (1 + np.exp(-g)) * u) @ T[p + "ffn_down_shexp.weight"].T
            gate = 1 / (1 + np.exp(-(h @ T[p + "ffn_gate_inp_shexp.weight"])))
            y += s * gate[:, None]
        return y

    def logits(self, ids):
        T, n, hd = self.t, len(ids), self.head_dim
        self.route_gap = np.inf  # the smallest margin of a token's last chosen expert over the next one
        self.choices = {}  # per layer prefix: per token (experts, weights, act(gate) * up of each)
        pos = np.arange(n, dtype=np.float64)
        x = T["token_embd.weight"][ids]
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for il in range(self.n_layer):
            p = f"blk.{il}."
            h = self.rms(x, T[p + "attn_norm.weight"])
            q, k, v = (h @ T[p + f"attn_{w}.weight"].T + T.get(p + f"attn_{w}.bias", 0.0) for w in "qkv")
            q, k, v = q.reshape(n, -1, hd), k.reshape(n, -1, hd), v.reshape(n, -1, hd)
            if p + "attn_q_norm.weight" in T:
                q, k = self.rms(q, T[p + "attn_q_norm.weight"]), self.rms(k, T[p + "attn_k_norm.weight"])
            q, k = self.rope(q, pos), self.rope(k, pos)
            rep = self.n_head // self.n_head_kv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
            if self.oss and il % 2 == 0:  # a sliding window: position i sees i - swa < j <= i
                s = s + np.tril(np.full((n, n), -np.inf), -self.swa)
            # a sink logit per head (gpt-oss) joins each softmax with a zero value
            sink = T[p + "attn_sinks.weight"][:, None, None] if p + "attn_sinks.weight" in T else -np.inf
            mx = np.maximum(s.max(-1, keepdims=True), sink)
            a = np.exp(s - mx)
            a /= a.sum(-1, keepdims=True) + np.exp(sink - mx)
            o = np.einsum("hqk,khd->qhd", a, v).reshape(n, -1)
            x = x + o @ T[p + "attn_output.weight"].T + T.get(p + "attn_output.bias", 0.0)
            norm = "post_attention_norm.weight" if self.oss else "ffn_norm.weight"  # gpt-oss's name for it
            x = x + self.moe(p, self.rms(x, T[p + norm]))
        return self.rms(x, T["output_norm.weight"]) @ T["output.weight"].T


def kld(ref, logits):
    """Mean KL(ref || logits) over rows."""
    return float(px.token_stats(px.log_softmax(ref), px.log_softmax(logits))["kld"].mean())


def llama_cpp_logits(path, ids):
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, n_batch=256, logits_all=True, verbose=False)
    llm.eval(ids)
    out = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    del llm
    return out


# ---- fidelity ----------------------------------------------------------------------------------


def test_hparams(f32_model):
    name, path = f32_model
    with optiml.Model(path, n_ctx=64, n_threads=2) as m:
        h = m.hparams
    want = {"qwen3moe": (8, 2, 64, 0), "qwen2moe": (8, 3, 32, 96), "mixtral": (4, 2, 64, 0), "gpt-oss": (8, 2, 64, 0)}[name]
    assert (h["n_expert"], h["n_expert_used"], h["n_ff_exp"], h["n_ff_shexp"]) == want


def test_float64_reference_and_llama_cpp(f32_model):
    """F32 weights: the prompt's logits against the float64 pass, as close as llama.cpp's."""
    name, path = f32_model
    ref = Reference(path).logits(IDS)
    with optiml.Model(path, n_ctx=256, n_threads=2) as m:
        ours = m.eval(IDS, all_logits=True)
    theirs = llama_cpp_logits(path, IDS)
    k_ours, k_theirs = kld(ref, ours), kld(ref, theirs)
    assert k_ours <= 1.1 * k_theirs + 1e-7, (k_ours, k_theirs)
    assert np.abs(ours - ref).max() < 5e-3  # routing mistakes would be O(1)
    assert np.abs(ours - theirs).max() < 5e-3


def test_decode_steps_match_the_batch(f32_model):
    """One token at a time (each expert's product a matrix-vector one) against the float64 pass."""
    name, path = f32_model
    ref = Reference(path).logits(IDS[:12])
    with optiml.Model(path, n_ctx=64, n_threads=2) as m:
        m.eval(IDS[:4])
        steps = np.stack([m.eval([t]) for t in IDS[4:12]])
    assert np.abs(steps - ref[4:12]).max() < 5e-3
    assert kld(ref[4:12], steps) < 1e-6


def test_long_prompt_many_tokens_per_expert(tmp_path):
    """200 tokens over 4 experts: each expert's batch spans several 64-token blocks of the batch kernel."""
    path = synthetic(tmp_path / "mixtral.gguf", *TINY, *ARCHS["mixtral"], "--type", "f32")
    ids = [(i * 104729) % 45000 + 200 for i in range(200)]
    ref = Reference(path).logits(ids)
    with optiml.Model(path, n_ctx=256, n_threads=2, n_batch=256) as m:
        ours = m.eval(ids, all_logits=True)
    theirs = llama_cpp_logits(path, ids)
    assert kld(ref, ours) <= 1.1 * kld(ref, theirs) + 1e-7
    assert np.abs(ours - ref).max() < 5e-3


# (arch, type, seed): seeds whose router has no near-tie in the float64 pass on these tokens (checked below),
# for a token whose k-th and (k+1)-th experts are within rounding of each other is a coin toss for any engine.
@pytest.mark.parametrize("arch,qtype,seed", [("qwen3moe", "q8_0", 5), ("qwen3moe", "q4_k", 7), ("qwen3moe", "q6_k", 5),
                                             ("qwen3moe", "mxfp4", 8),
                                             ("gpt-oss", "q8_0", 7), ("gpt-oss", "q4_k", 7), ("gpt-oss", "mxfp4", 10)])
def test_quantized_experts(tmp_path, arch, qtype, seed):
    """Quantized experts (and attention): KLD against the float64 pass on the dequantized weights within
    10% of llama.cpp's, and teacher-forced greedy agreement with llama.cpp away from near-ties. (gpt-oss: a
    window of 16 positions on layer 0, so the 40-token prompt leaves it.)"""
    extra = ["--sliding-window", "16"] if arch == "gpt-oss" else []
    path = synthetic(tmp_path / f"{arch}_{qtype}.gguf", "--n-embd", "256", "--n-layer", "2", "--n-head", "4",
                     "--n-head-kv", "2", "--std", "0.1", "--router-std", "0.3", "--arch", arch, "--n-ff", "512",
                     "--experts", "16", "--experts-used", "4", "--n-ff-exp", "256", "--type", qtype,
                     "--output-type", "q8_0", "--seed", str(seed), *extra)
    oracle = Reference(path)
    ref = oracle.logits(IDS)
    assert oracle.route_gap > 0.02, f"the router has a near-tie (margin {oracle.route_gap:.4f}): pick another seed"
    with optiml.Model(path, n_ctx=256, n_threads=2) as m:
        ours = m.eval(IDS, all_logits=True)
    theirs = llama_cpp_logits(path, IDS)
    k_ours, k_theirs = kld(ref, ours), kld(ref, theirs)
    print(f"{arch} {qtype}: KLD against float64 ours {k_ours:.3e}, llama.cpp {k_theirs:.3e}")
    assert k_ours <= 1.1 * k_theirs + 1e-5, (k_ours, k_theirs)
    # Teacher-forced: the same sequence through both; where both are decided, the same argmax.
    decided = (top2_gap(ours) > TIE) & (top2_gap(theirs) > TIE)
    assert decided.sum() >= len(IDS) // 3
    assert (ours.argmax(1) == theirs.argmax(1))[decided].all()


# ---- the profiler ----------------------------------------------------------------------------------


def test_profiler_records_the_routing(f32_model):
    """`optiml profile`'s recorder on a mixture of experts: which experts each layer chose (counts, weights,
    consecutive pairs) and which neurons inside them fired, against the float64 pass; a new chunk does not
    pair with the one before."""
    from optiml.offline.profile import run_chunks

    name, path = f32_model
    oracle = Reference(path)
    chunks = [IDS[:24], IDS[24:40]]
    choices, gap = {}, np.inf
    for c in chunks:
        oracle.logits(c)
        gap = min(gap, oracle.route_gap)
        for p, v in oracle.choices.items():
            choices.setdefault(p, []).extend(v)
    first_len = len(chunks[0])
    if gap < 1e-3:
        pytest.skip(f"a near-tie in the router (margin {gap:.2e})")
    L, X, k = oracle.n_layer, oracle.n_expert, oracle.k
    thr = 0.05
    with optiml.Model(path, n_ctx=64, n_threads=2) as m:
        rec = optiml._core.ActivationRecorder(m._model, np.full(L, thr, dtype=np.float32))
        run_chunks(m, chunks, rec)
        r = rec.result()
    assert r["n_tokens"] == 40
    for il in range(L):
        toks = choices[f"blk.{il}."]
        count, weight = np.zeros(X, np.int64), np.zeros(X)
        nxt = np.zeros((X, X), np.int64)
        fired, near = np.zeros((X, r["expert_fired"].shape[2]), np.int64), 0
        for t, (top, w, hs) in enumerate(toks):
            count[top] += 1
            weight[top] += w
            if t > 0 and t != first_len:  # the second chunk's first token follows nothing
                for a in toks[t - 1][0]:
                    nxt[a, top] += 1
            for e, h in zip(top, hs):
                fired[e] += np.abs(h) > thr
                near += int((np.abs(np.abs(h) - thr) < 1e-4).sum())
        np.testing.assert_array_equal(r["expert_count"][il], count)
        np.testing.assert_allclose(r["expert_weight"][il], weight, rtol=1e-3, atol=1e-4)  # f32 softmax
        np.testing.assert_array_equal(r["expert_next"][il], nxt)
        assert np.abs(r["expert_fired"][il] - fired).sum() <= near
    assert r["expert_next"].sum() == L * (24 - 1 + 16 - 1) * k * k


def test_profile_cli_on_experts(q3_path, tmp_path, monkeypatch):
    """`optiml profile` on a mixture of experts: the stats file holds the experts' arrays (they load back),
    the summary names the experts' skew; `optiml calibrate` refuses the model with a reason. (`optiml solve`
    on them: test_solve_places_the_hottest_experts.)"""
    from optiml.formats import stats as ostats

    text = tmp_path / "text.txt"
    text.write_text("The history of the printing press begins in the fifteenth century. " * 40)
    out = tmp_path / "q3.stats.npz"
    cmd = [sys.executable, "-m", "optiml", "profile", "-m", str(q3_path), "--data", str(text), "--tokens", "300",
           "--ctx", "128", "-q", "-o", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "experts: the top 10%" in p.stdout and "neurons inside the experts" in p.stdout
    st = ostats.load(out)
    assert st.is_moe and st.expert_count.shape == (2, 8) and st.expert_next.shape == (2, 8, 8)
    assert st.expert_freq.shape == (2, 8, 64) and 0 < st.expert_freq.mean() < 1
    assert (st.expert_count.sum(axis=1) == st.n_tokens * 2).all()
    with pytest.raises(optiml.OptimlError, match="nothing to calibrate"):
        optiml.calibrate(str(q3_path), None, texts=[text.read_text()], target=0.5, progress=False)
    with pytest.raises(optiml.OptimlError, match="samples"):
        optiml.profile(str(q3_path), None, texts=[text.read_text()], n_tokens=100, samples=8, progress=False)

    # `optiml info --stats --plot`: the experts' curves (routings per expert), not the dense FFN's empty ones
    from optiml import cli
    from optiml.cli import info as info_cli

    drawn = {}
    monkeypatch.setattr(info_cli, "plot", lambda png, ranks, freq, cov, n, **kw: drawn.update(freq=freq, n=n, **kw))
    assert cli.main(["-q", "info", str(q3_path), "--stats", str(out), "--plot", str(tmp_path / "q3.png")]) == 0
    assert drawn["unit"] == "expert" and drawn["n"] == 8
    np.testing.assert_allclose(drawn["freq"][:, 0], st.expert_count.max(axis=1) / st.n_tokens)


# ---- malformed metadata and what is not supported -------------------------------------------------


@pytest.fixture(scope="module")
def q3_path(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("moe") / "q3.gguf", *TINY, *ARCHS["qwen3moe"], "--type", "f32")


def edited(src, dst, set_kv=None, remove=()):
    from optiml.formats.gguf_edit import rewrite_gguf

    rewrite_gguf(str(src), str(dst), set_kv=set_kv or {}, remove_prefixes=tuple(remove))
    return dst


U32 = gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("key,value,message", [
    ("qwen3moe.expert_count", 0, "expert_count = 0"),
    ("qwen3moe.expert_used_count", 9, "expert_used_count = 9"),
    ("qwen3moe.expert_used_count", 0, "expert_used_count = 0"),
    ("qwen3moe.expert_feed_forward_length", 32, "ffn_gate_exps.weight has shape [64, 64, 8], expected [64, 32, 8]"),
    ("qwen3moe.expert_count", 6, "expected [64, 6]"),
])
def test_malformed_metadata_refused(q3_path, tmp_path, key, value, message):
    bad = edited(q3_path, tmp_path / "bad.gguf", {key: (value, U32)})
    with pytest.raises(optiml.GGUFError, match=message.replace("[", r"\[").replace("]", r"\]")):
        optiml.Model(bad, n_ctx=64)


@pytest.fixture(scope="module")
def oss_path(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("oss") / "oss.gguf", *TINY, *ARCHS["gpt-oss"], "--type", "q8_0")


@pytest.mark.parametrize("remove,set_kv,error,message", [
    (("gpt-oss.attention.sliding_window",), {}, optiml.GGUFError, "gpt-oss.attention.sliding_window"),
    ((), {"gpt-oss.rope.scaling.yarn_log_multiplier": (0.1, gguf.GGUFValueType.FLOAT32)},
     optiml.UnsupportedModelError, "yarn_log_multiplier"),
    ((), {"gpt-oss.rope.scaling.yarn_attn_factor": (-1.0, gguf.GGUFValueType.FLOAT32)}, optiml.GGUFError, "YaRN"),
])
def test_malformed_gpt_oss_refused(oss_path, tmp_path, remove, set_kv, error, message):
    bad = edited(oss_path, tmp_path / "bad.gguf", set_kv, remove)
    with pytest.raises(error, match=message):
        optiml.Model(bad, n_ctx=64)


def test_gpt_oss_tensors_checked(oss_path, tmp_path):
    """A sink vector of the wrong length and a missing expert bias's shape are refused by name."""
    from optiml.formats.gguf_edit import rewrite_gguf

    bad = tmp_path / "bad.gguf"
    rewrite_gguf(str(oss_path), str(bad), transforms={"blk.1.attn_sinks.weight": lambda t, a: (a.reshape(-1)[:8], 0, (2,))}, progress=False)
    with pytest.raises(optiml.OptimlError, match="blk.1.attn_sinks.weight"):
        optiml.Model(bad, n_ctx=64)
    rewrite_gguf(str(oss_path), str(bad), transforms={"blk.0.ffn_down_exps.bias": lambda t, a: (a[:4], 0, (64, 4))}, progress=False)
    with pytest.raises(optiml.GGUFError, match=r"blk.0.ffn_down_exps.bias is F32 \[64, 4\], expected F32 \[64, 8\]"):
        optiml.Model(bad, n_ctx=64)


def test_missing_expert_count_refused(q3_path, tmp_path):
    bad = edited(q3_path, tmp_path / "bad.gguf", remove=("qwen3moe.expert_count",))
    with pytest.raises(optiml.GGUFError, match="mixture-of-experts architecture.*expert_count"):
        optiml.Model(bad, n_ctx=64)
    # A Mixtral (llama) file, where no expert count means a dense FFN: its expert tensors are named, not a dense
    # FFN tensor it never had (llama.cpp aborts on these files).
    mixtral = synthetic(tmp_path / "mixtral.gguf", *TINY, *ARCHS["mixtral"], "--type", "f32")
    for how in (dict(remove=("llama.expert_count",)), dict(set_kv={"llama.expert_count": (0, U32)})):
        bad = edited(mixtral, tmp_path / "bad-mixtral.gguf", **how)
        with pytest.raises(optiml.GGUFError, match="has expert tensors .*expert_count"):
            optiml.Model(bad, n_ctx=64)


# ---- experts on a second device (cpu:1), or kept on the CPU (n_cpu_moe) ----------------------------------


def device_logits(path, ids=IDS, **kw):
    with optiml.Model(path, n_ctx=64, n_threads=2, **kw) as m:
        a = m.eval(ids, all_logits=True)
        b = m.eval([ids[1]])
        alloc = sum(m._session.device_allocations.values())
        return np.vstack([a, b[None]]), m.plan, alloc


@pytest.mark.parametrize("where", [dict(n_gpu_layers=2), dict(n_gpu_layers=2, n_cpu_moe=True),
                                   dict(n_gpu_layers=2, n_cpu_moe=1), dict(n_gpu_layers=1), dict(vram="1MiB")])
def test_experts_on_a_device_give_the_cpu_bits(f32_model, where):
    """Whole mixtures of experts on the device (with its attention), or kept on the CPU while the layer's
    attention runs on the device (cpu_moe / n_cpu_moe, llama.cpp's meaning): the same operations on the
    same bits, the residual's xn and y crossing where the experts run."""
    _, path = f32_model
    ref, _, _ = device_logits(path, device="cpu")
    got, plan, alloc = device_logits(path, device="cpu:1", **where)
    assert np.array_equal(got, ref), plan
    assert alloc == plan.device_bytes["total"]  # the plan counts what the device holds, byte for byte
    experts = [l["ffn_on_device"] > 0 for l in plan.layers]
    attention = [l["attention"] == "cpu:1" for l in plan.layers]
    if where.get("n_cpu_moe") is True:
        assert experts == [False, False] and attention == [True, True]
        assert plan.device_bytes["ffn_weights"] == 0 and "experts on the CPU" in plan._d["reason"]
    elif where.get("n_cpu_moe") == 1:
        assert experts == [False, True] and attention == [True, True]
    elif "n_gpu_layers" in where:
        assert experts == attention and sum(attention) == where["n_gpu_layers"]
        assert plan.device_bytes["ffn_weights"] > 0


def test_moe_placement_arguments_refused(q3_path):
    # n_cpu_moe past the layers means all of them, as llama.cpp's --n-cpu-moe takes it (and -ngl here)
    past = optiml.plan.make(q3_path, n_ctx=64, device="cpu:1", n_cpu_moe=3)
    assert str(past) == str(optiml.plan.make(q3_path, n_ctx=64, device="cpu:1", n_cpu_moe=True))
    with pytest.raises(optiml.ArgumentError, match="non-negative integer"):
        optiml.Model(q3_path, n_ctx=64, device="cpu:1", n_cpu_moe=-1)
    with pytest.raises(optiml.ArgumentError, match="gpu_neurons: this model's layers are mixtures of experts"):
        optiml.Model(q3_path, n_ctx=64, device="cpu:1", gpu_neurons=32)


def test_n_cpu_moe_refused_without_experts(smollm2_path):
    with pytest.raises(optiml.ArgumentError, match="this model has no experts"):
        optiml.plan.make(smollm2_path, n_ctx=64, device="cpu:1", n_cpu_moe=1)


def test_cli_cpu_moe(q3_path):
    """`optiml info --plan` with llama.cpp's flags: --cpu-moe and -ncmoe N (their meaning), --cpu-moe with
    -ncmoe refused by the parser."""
    def plan(*flags):
        r = subprocess.run([sys.executable, "-m", "optiml", "info", str(q3_path), "--plan", "--device", "cpu:1",
                            "-ngl", "2", *flags], capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr
    rc, out = plan("--cpu-moe")
    assert rc == 0 and "every layer's experts on the CPU" in out, out
    rc, out = plan("-ncmoe", "1")
    assert rc == 0 and "the experts of layer 0 on the CPU" in out and "8 of 16 experts" in out, out
    rc, out = plan("--cpu-moe", "-ncmoe", "1")
    assert rc == 2 and "not allowed with argument" in out, out


# ---- hot experts on the device, cold ones on the CPU, in the same layer (#46 item 5) ----------------------


@pytest.mark.parametrize("lists", [
    [[3, 1], [0, 5, 7]],           # a few experts of each layer
    [[], [2]],                     # one layer split, the other whole on the CPU
    [list(range(8)), [6]],         # one layer whole on the device, one split
    [[7, 6, 5, 4, 3, 2, 1], [0]],  # all but one
])
def test_hot_experts_split_give_the_cpu_bits(f32_model, lists):
    """A layer's listed experts on the device (cpu:1), the others on the CPU, both at once: the router at
    home, every expert's rows on one side in the unsplit order, the sum at home (here the device) best
    first, as the unsplit run; so the same bits, also with a shared expert (qwen2moe) and for the mixtral-shaped model's
    4 experts (lists cut to its experts)."""
    name, path = f32_model
    n_expert = {"qwen3moe": 8, "qwen2moe": 8, "mixtral": 4, "gpt-oss": 8}[name]
    lists = [[e for e in ids if e < n_expert] for ids in lists]
    ref, _, _ = device_logits(path, device="cpu")
    got, plan, alloc = device_logits(path, device="cpu:1", gpu_experts=lists)
    assert np.array_equal(got, ref), plan
    assert alloc == plan.device_bytes["total"]  # the plan counts what the device holds, byte for byte
    for l, ids in zip(plan.layers, lists):
        whole = len(ids) == n_expert
        assert l["device_experts"] == ([] if whole else ids)
        assert (l["ffn_on_device"] > 0) == whole
    if any(0 < len(ids) < n_expert for ids in lists):
        assert "experts split in" in str(plan)


def test_split_experts_with_the_attention_on_the_cpu(q3_path, tmp_path):
    """The file's placement (as optiml solve writes it) with a layer's attention on the CPU and some of its
    experts on the device: the router runs on the host, the device only computes its experts; same bits."""
    from optiml.formats.gguf_edit import GGUFValueType as VT

    i32 = lambda v: (np.asarray(v, dtype=np.int32), VT.ARRAY)  # noqa: E731
    placed = edited(q3_path, tmp_path / "placed.gguf", {
        "optiml.placement.gpu_attention": i32([0, 1]), "optiml.placement.gpu_expert_count": i32([2, 3]),
        "optiml.placement.gpu_experts": i32([6, 2, 1, 0, 4])})
    ref, _, _ = device_logits(q3_path, device="cpu")
    got, plan, alloc = device_logits(placed, device="cpu:1")
    assert np.array_equal(got, ref), plan
    assert alloc == plan.device_bytes["total"]
    assert [l["attention"] for l in plan.layers] == ["cpu", "cpu:1"]
    assert [l["device_experts"] for l in plan.layers] == [[6, 2], [1, 0, 4]]
    assert "the file's expert placement" in plan.reason
    # a budget holds what it holds: the hottest of each list first
    budget = plan.device_bytes["total"] - plan.device_bytes["output"] - 30000  # the logits, and one expert less
    _, plan, alloc = device_logits(placed, device="cpu:1", vram=budget)
    assert alloc == plan.device_bytes["total"]
    assert all(l["device_experts"] == ids[:len(l["device_experts"])] for l, ids in zip(plan.layers, [[6, 2], [1, 0, 4]]))
    assert sum(len(l["device_experts"]) for l in plan.layers) < 5
    # n_cpu_moe (llama.cpp's flag) keeps the experts of its first layers on the CPU, the file's placement the
    # others' (0: none, as if not given; it dropped the whole placement)
    for n, lists in ((True, [[], []]), (1, [[], [1, 0, 4]]), (0, [[6, 2], [1, 0, 4]])):
        got, plan, alloc = device_logits(placed, device="cpu:1", n_cpu_moe=n)
        assert alloc == plan.device_bytes["total"] and np.array_equal(got, ref)
        assert [l["device_experts"] for l in plan.layers] == lists, (n, plan)
        assert "the file's expert placement" in plan.reason
    assert plan.device_bytes["ffn_weights"] > 0 and "5 of 16 experts" in str(plan)
    # a placement with no attention on the device and n_cpu_moe for all its experts: the reason says that
    # n_cpu_moe left the device nothing, not that nothing fits the budget
    bare = edited(q3_path, tmp_path / "bare.gguf", {
        "optiml.placement.gpu_attention": i32([0, 0]), "optiml.placement.gpu_expert_count": i32([2, 3]),
        "optiml.placement.gpu_experts": i32([6, 2, 1, 0, 4])})
    plan = optiml.plan.make(bare, n_ctx=64, device="cpu:1", n_cpu_moe=True)
    assert plan.device_bytes["total"] == 0 and "nothing is left for the device" in plan.reason, plan.reason
    assert "budget" in optiml.plan.make(bare, n_ctx=64, device="cpu:1", vram="1KiB").reason
    nothing = edited(q3_path, tmp_path / "nothing.gguf", {  # (a placement that itself puts nothing on the device)
        "optiml.placement.gpu_attention": i32([0, 0]), "optiml.placement.gpu_expert_count": i32([0, 0]),
        "optiml.placement.gpu_experts": i32([])})
    assert "n_cpu_moe" not in optiml.plan.make(nothing, n_ctx=64, device="cpu:1").reason


def test_whole_lists_that_do_not_fit_split(q3_path):
    """Every expert listed, a budget that holds the attention and only some of them: the layers split (the
    first split takes the split buffers from the budget too), counted as allocated."""
    ref, _, _ = device_logits(q3_path, device="cpu")
    _, whole, _ = device_logits(q3_path, device="cpu:1", gpu_experts=[list(range(8))] * 2)
    assert [l["ffn_on_device"] for l in whole.layers] == [128, 128]
    budget = whole.device_bytes["total"] - whole.device_bytes["output"] - 200000
    got, plan, alloc = device_logits(q3_path, device="cpu:1", gpu_experts=[list(range(8))] * 2, vram=budget)
    assert np.array_equal(got, ref), plan
    assert alloc == plan.device_bytes["total"] <= budget
    assert any(l["device_experts"] for l in plan.layers)


@pytest.mark.parametrize("counts,ids,message", [
    ([2, 2], [6, 2, 1, 0, 4], "adds up to 4 of the 5"),
    ([2, 3], [6, 6, 1, 0, 4], "layer 0 lists expert 6 twice"),
    ([2, 3], [6, 9, 1, 0, 4], "layer 0 lists expert 9; the model's experts are 0..7"),
    ([2], [6, 2], "gpu_expert_count has 1 values for 2 layers"),
])
def test_malformed_expert_placement_refused(q3_path, tmp_path, counts, ids, message):
    from optiml.formats.gguf_edit import GGUFValueType as VT

    bad = edited(q3_path, tmp_path / "bad.gguf", {
        "optiml.placement.gpu_expert_count": (np.asarray(counts, dtype=np.int32), VT.ARRAY),
        "optiml.placement.gpu_experts": (np.asarray(ids, dtype=np.int32), VT.ARRAY)})
    with pytest.raises(optiml.GGUFError, match=message.replace("(", r"\(").replace(")", r"\)")):
        optiml.Model(bad, n_ctx=64)


def test_gpu_experts_refused(q3_path, smollm2_path):
    def plan(**kw):
        return optiml.plan.make(q3_path, n_ctx=64, device="cpu:1", **kw)
    with pytest.raises(optiml.ArgumentError, match="one list of expert ids per layer"):
        plan(gpu_experts=[1, 2])
    with pytest.raises(optiml.ArgumentError, match="3 lists for 2 layers"):
        plan(gpu_experts=[[1], [2], [3]])
    with pytest.raises(optiml.ArgumentError, match="layer 1 lists expert 8; the model's experts are 0..7"):
        plan(gpu_experts=[[1], [8]])
    with pytest.raises(optiml.ArgumentError, match="layer 0 lists expert 1 twice"):
        plan(gpu_experts=[[1, 1], [2]])
    with pytest.raises(optiml.ArgumentError, match="n_gpu_layers says it too"):
        plan(gpu_experts=[[1], [2]], n_gpu_layers=2)
    with pytest.raises(optiml.ArgumentError, match="n_cpu_moe says it too"):
        plan(gpu_experts=[[1], [2]], n_cpu_moe=1)
    with pytest.raises(optiml.ArgumentError, match="the model has no experts"):
        optiml.plan.make(smollm2_path, n_ctx=64, device="cpu:1", gpu_experts=[[0]] * 30)
    assert "gpu_experts ignored" in optiml.plan.make(q3_path, n_ctx=64, device="cpu", gpu_experts=[[1], [2]]).reason


def test_solve_places_the_hottest_experts(q3_path, tmp_path):
    """`optiml profile` then `optiml solve` on a mixture of experts: each layer's GPU experts are a prefix of
    its experts by how often the router chose them, within the budget; the placed file keeps the weights,
    reads back, and runs split on cpu:1 with the CPU run's bits and the solver's experts."""
    from optiml.formats import stats as ostats
    from optiml.formats.placement import read_placement
    from optiml.offline.solve_experts import expert_layout

    text = tmp_path / "text.txt"
    text.write_text("The history of the printing press begins in the fifteenth century. " * 40)
    st_path = tmp_path / "q3.stats.npz"
    p = subprocess.run([sys.executable, "-m", "optiml", "profile", "-m", str(q3_path), "--data", str(text),
                        "--tokens", "300", "--ctx", "128", "-q", "-o", str(st_path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    st = ostats.load(st_path)
    lay = expert_layout(q3_path)
    logits = 4 * 64 * lay["n_vocab"]  # the plan's rows of logits beside the output matrix
    fixed = lay["weights_fixed"] + lay["kv_per_token"] * 64 + lay["scratch_per_token"] * 64 + logits
    budget = fixed + 5 * lay["expert_bytes"][0] + 1000
    out = tmp_path / "placed.gguf"
    hw = tmp_path / "hw.json"  # a CPU slow enough that experts this small pay for the device's costs
    hw.write_text('{"cpu_bandwidth": 1e6, "gpu_bandwidth": 1e12}')
    p = subprocess.run([sys.executable, "-m", "optiml", "solve", "-m", str(q3_path), "--stats", str(st_path),
                        "--vram", str(budget), "--ctx", "64", "--batch", "64", "--hardware", str(hw), "-o", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "experts on the GPU per layer" in p.stdout
    d = read_placement(out)
    lists = d["gpu_experts"]
    assert 0 < sum(len(ids) for ids in lists) <= 5
    for l, ids in enumerate(lists):
        count = st.expert_count[l]
        assert sorted(count[ids].tolist(), reverse=True) == count[ids].tolist()  # hottest first
        if ids:  # a prefix of the experts by count: none left out is hotter than one placed
            assert count[ids].min() >= np.delete(count, ids).max(initial=0)
    ref, _, _ = device_logits(q3_path, device="cpu")
    got, plan, alloc = device_logits(out, device="cpu:1", n_batch=64, vram=budget)
    assert np.array_equal(got, ref), plan
    assert [l["device_experts"] for l in plan.layers] == lists
    assert alloc <= budget
    # A budget that holds fewer experts than the file lists (as steps of more tokens than the solver counted
    # would leave, their scratch being larger): the plan says how many of them it kept, and why.
    if sum(len(ids) for ids in lists) > 1:
        short = plan.device_bytes["total"] - plan.device_bytes["output"] - 1  # (the output matrix goes last)
        _, plan, _ = device_logits(out, device="cpu:1", n_batch=64, vram=short)
        kept = sum(len(l["device_experts"]) for l in plan.layers)
        assert f"{kept} of the {sum(len(ids) for ids in lists)} experts it lists fit in the budget at n_batch 64" \
            in plan.reason, plan.reason


def test_dense_expert_runs_skip_nothing_and_predictors_refuse_early(q3_path, tmp_path):
    """The FFN meter counts a mixture of experts as computed (its experts run whole: it read 100% skipped),
    and train-predictors refuses one before its sampling pass."""
    with optiml.Model(q3_path, n_ctx=64, n_threads=1) as m:
        m.eval(list(range(300, 305)))
        active, seen = m._session.sparsity_counts()
        assert seen.sum() > 0 and (active == seen).all()
    from optiml.offline.predictors import train_predictors

    with pytest.raises(optiml.ArgumentError, match="a mixture of experts; activation predictors do not handle"):
        train_predictors(q3_path, None, texts=["some text"], out=str(tmp_path / "p.gguf"))
