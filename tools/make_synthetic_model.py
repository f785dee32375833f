#!/usr/bin/env python3
"""Writes a llama-architecture GGUF of a given shape with random weights, for speed benchmarks of
models too big to download (the default is 7B-shaped: LLaMA-2-7B's layers with a 49152-token vocab).

The tokenizer (every tokenizer.* key) is copied from a donor GGUF, SmolLM2-135M-Instruct by default,
so llama.cpp and OptiML both load and tokenize the file; n_vocab is therefore the donor's (49152).
Weights are normal(0, --std) (drawn as 65536 quantiles, see rand()) like a trained model's at
initialization, RMS-norm weights 1.0, so activations stay finite through every layer (7B: logits have
std ~1.3); the text it generates is of course noise. A 7B file (3.61 GiB) takes ~1.5-2 minutes on 2 cores.

--activation relu adds the metadata key optiml.ffn.activation = "relu": OptiML then computes
relu(gate) * up in every FFN (about half of the neurons are exactly zero before any calibration).
llama.cpp does not read that key and runs SiLU on the same file: the same amount of work per token,
which is all a speed comparison needs (its outputs differ from OptiML's on such a file).

--plant-firing MEAN plants activation locality, as hybrid execution needs to be measured: each layer's
FFN neurons fire with probabilities that follow a power law (a few neurons for almost every token, most
rarely; the hottest 20% take 80% of the firings where MEAN allows, a random order per layer) averaging
MEAN. How: every token embedding gets a common component c*u (u a fixed unit vector, as large as the
random part), and gate row j gets beta_j*u, which shifts that neuron's pre-activation by a constant so that
P(gate_j . x > 0) is its planted probability; attn_output and ffn_down are 10x smaller so the residual
stream stays near the embedding through every layer (the layers' random outputs would wash u out).
With --activation relu a neuron fires exactly when its gate is positive; with SiLU the hot neurons are the
ones with large activations, which is what calibration keeps. The speed of a dense run does not depend on
the values, so llama.cpp's side of a comparison is unaffected.

--plant-rank R (with --plant-firing) makes that firing predictable from the layer's input, as activation
predictors need: the random part of every gate row lies in one R-dimensional subspace (random, orthogonal to
u, scaled so that each neuron's firing rate stays as planted), so whether a neuron fires is a function of
the input's R coordinates there plus the shift along u: a predictor of rank R + 1 with a bias can learn it
(the quantization of the gate adds a little noise that it cannot).

--plant-clusters C plants co-activation: each layer's neurons fall into clusters of C (a random
assignment, so a cluster's rows lie scattered through the file), and every gate row of cluster c is
sqrt(--cluster-share) * std * sqrt(E) * d_c plus the rest of its random part, d_c a random unit vector of the
cluster (up rows likewise with their own e_c). The neurons of a cluster then see nearly the same gate and up
values, so they fire together; d_c . x_n decides a cluster's gate sign, which a predictor of rank n_ff / C
learns exactly (cluster_layout() gives the assignment and directions; tools/bench/coactive.py uses them).

Tensors are generated, quantized (optiml.quant.quantize, native and multithreaded) and written one at
a time (optiml.convert.writer.write_gguf), so memory stays near the largest tensor in float32
(token_embd: 49152 x 4096 x 4 bytes = 0.8 GB); the file appears only once complete.

    PYTHONPATH=python python tools/make_synthetic_model.py --activation relu \
        -o /work/synth-models/llama7b-relu-q4_0.gguf
    PYTHONPATH=python python tools/make_synthetic_model.py -o /tmp/tiny.gguf \
        --n-embd 256 --n-layer 2 --n-ff 704 --n-head 4 --n-head-kv 4

Mixtures of experts (--experts N), in llama.cpp's layout: 3-D ffn_{gate,up,down}_exps of N experts of
--n-ff-exp neurons, the router ffn_gate_inp (F32, as llama.cpp's quantizer keeps it), and with
--shared-expert S a shared expert of S neurons with its sigmoid gate ffn_gate_inp_shexp. --arch picks the
architecture: qwen3 (dense, per-head q/k norms; no --experts), qwen3moe (per-head q/k norms), qwen2moe
(q/k/v biases, a shared expert), llama with experts (Mixtral), or gpt-oss (biases on q/k/v/o, the router and every expert; a sink logit per head;
every other layer a sliding window of --sliding-window positions; YaRN RoPE of factor 32 over 4096
original positions, base 150000; llama.cpp's tensor names). --plant-experts ALPHA plants skewed expert popularity (as trained MoEs have): the
router row of the expert of popularity rank r gets a component along the embeddings' common direction u
(as --plant-firing makes it) that falls with r, so expert use follows roughly a power law of exponent
ALPHA (a random order per layer). Qwen3-30B-A3B's shape with 4 layers, for tools/bench_moe.py:

    PYTHONPATH=python python tools/make_synthetic_model.py --arch qwen3moe -o /tmp/q3moe.gguf \
        --n-embd 2048 --n-layer 4 --n-head 32 --n-head-kv 4 --head-dim 128 --experts 128 --experts-used 8 \
        --n-ff-exp 768 --n-ff 6144 --type q4_k --plant-experts 1.0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import gguf
import numpy as np

from optiml import quant
from optiml.hub import registry as models
from optiml.convert import writer

# tools/fetch_models.py smollm2-135m-instruct-q4_1 puts it there (the cache honours OPTIML_HOME / OPTIML_MODEL_CACHE)
# $OPTIML_TOKENIZER_DONOR where set (tools/checks/gpu_check.sh's small donor: the GPU machine has no model cache)
DEFAULT_DONOR = os.environ.get("OPTIML_TOKENIZER_DONOR") or str(models.cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf")

# ggml file types for the general.file_type key (informational: llama.cpp prints it, nothing reads it)
_FTYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k": 12,
          "q4_k": 15, "q5_k": 17, "q6_k": 18, "bf16": 32, "mxfp4": 38}


def donor_tokenizer(path: str) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """(key, value, type, array item type) of every tokenizer.* key of the donor GGUF."""
    r = gguf.GGUFReader(path)
    out = []
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        out.append((key, field.contents(), vtype, sub))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise SystemExit(f"{path}: no tokenizer.ggml.tokens in this GGUF; pass another --tokenizer-from")
    return out


def power_law_firing(n: int, mean: float) -> np.ndarray:
    """Firing probabilities of n neurons, hottest first: p_r = p0 (r + 1)^-alpha clipped to [1e-4, 0.98],
    with mean `mean` and the hottest 20% taking 80% of the firings (or as much as the clip allows)."""
    r = np.arange(1, n + 1, dtype=np.float64)
    top = min(0.8, 0.95 * 0.98 * 0.2 / mean)

    def with_alpha(alpha):
        lo, hi = 1e-12, 1e12
        for _ in range(200):  # p0 for this alpha: the clipped mean grows with p0
            p0 = (lo * hi) ** 0.5
            p = np.clip(p0 * r ** -alpha, 1e-4, 0.98)
            lo, hi = (p0, hi) if p.mean() < mean else (lo, p0)
        return p

    lo, hi = 0.0, 6.0
    for _ in range(60):
        alpha = (lo + hi) / 2
        p = with_alpha(alpha)
        lo, hi = (alpha, hi) if p[: n // 5].sum() / p.sum() < top else (lo, alpha)
    return p


def cluster_layout(seed: int, layer: int, n_ff: int, size: int, n_embd: int, which: int = 0):
    """--plant-clusters' structure of one layer: the cluster of each neuron (int64 [n_ff]) and the clusters'
    unit directions (float32 [n_ff // size, n_embd]) of its gate rows (which=0) or up rows (which=1)."""
    n_clusters = n_ff // size
    of = np.random.default_rng([seed, 17, layer]).permutation(n_ff) % n_clusters
    d = np.random.default_rng([seed, 19 + which, layer]).standard_normal((n_clusters, n_embd)).astype(np.float32)
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return of, d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", required=True, help="output GGUF path")
    ap.add_argument("--n-embd", type=int, default=4096)
    ap.add_argument("--n-layer", type=int, default=32)
    ap.add_argument("--n-ff", type=int, default=11008)
    ap.add_argument("--n-head", type=int, default=32)
    ap.add_argument("--n-head-kv", type=int, default=32)
    ap.add_argument("--n-ctx-train", type=int, default=4096, help="llama.context_length")
    ap.add_argument("--type", default="q4_0", help="type of the 2-D weights (any optiml.quant type; default q4_0)")
    ap.add_argument("--output-type", default=None, help="type of output.weight and token_embd.weight "
                    "(default: --type)")
    ap.add_argument("--expert-type", default=None, help="type of the 3-D expert tensors ffn_*_exps (default: "
                    "--type; gpt-oss files, say, hold MXFP4 experts beside Q8_0 attention)")
    ap.add_argument("--activation", choices=("silu", "relu"), default="silu")
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the random weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plant-firing", type=float, default=None, metavar="MEAN",
                    help="plant power-law FFN firing with this mean rate per neuron (0 < MEAN < 1): see above")
    ap.add_argument("--plant-rank", type=int, default=None, metavar="R",
                    help="with --plant-firing: gate rows' random parts in one R-dimensional subspace (see above)")
    ap.add_argument("--plant-clusters", type=int, default=None, metavar="C",
                    help="plant co-activation: FFN neurons in clusters of C that fire together (see above)")
    ap.add_argument("--cluster-share", type=float, default=0.9,
                    help="share of a clustered gate/up row's variance that its cluster's direction holds")
    ap.add_argument("--tokenizer-from", default=DEFAULT_DONOR, help="GGUF whose tokenizer is copied "
                    "(its vocab size becomes n_vocab; default: $OPTIML_TOKENIZER_DONOR, else SmolLM2's in the cache)")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    ap.add_argument("--arch", choices=("llama", "qwen3", "qwen3moe", "qwen2moe", "gpt-oss"), default="llama")
    ap.add_argument("--sliding-window", type=int, default=128, help="gpt-oss: the window of its even layers")
    ap.add_argument("--head-dim", type=int, default=None, help="per-head size (default n_embd / n_head)")
    ap.add_argument("--experts", type=int, default=0, help="experts per layer (0: a dense FFN)")
    ap.add_argument("--experts-used", type=int, default=2, help="experts each token uses")
    ap.add_argument("--n-ff-exp", type=int, default=None, help="neurons per expert (default --n-ff)")
    ap.add_argument("--shared-expert", type=int, default=None, metavar="S",
                    help="a shared expert of S neurons (default: --n-ff for qwen2moe, none otherwise)")
    ap.add_argument("--plant-experts", type=float, default=None, metavar="ALPHA",
                    help="skewed expert popularity, roughly power law of exponent ALPHA: see above")
    ap.add_argument("--router-std", type=float, default=None, help="std of the router's weights (default --std)")
    a = ap.parse_args(argv)
    moe = a.experts > 0
    if a.arch not in ("llama", "qwen3") and not moe:
        ap.error(f"--arch {a.arch} is a mixture of experts: give --experts")
    if a.arch == "qwen3" and moe:
        ap.error("--arch qwen3 is dense (qwen3moe has experts)")
    if moe and not 0 < a.experts_used <= a.experts:
        ap.error("--experts-used must be in 1..--experts")
    if a.plant_experts is not None and not moe:
        ap.error("--plant-experts needs --experts")
    if a.arch == "llama" and moe and a.n_ff_exp not in (None, a.n_ff):
        ap.error("Mixtral's experts are --n-ff wide (llama.cpp reads no expert_feed_forward_length for llama)")
    FFX = a.n_ff_exp or a.n_ff
    oss = a.arch == "gpt-oss"
    if oss and a.activation != "silu":
        ap.error("gpt-oss has its own activation (a clamped SwiGLU): no --activation")
    SH = a.shared_expert if a.shared_expert is not None else (a.n_ff if a.arch == "qwen2moe" else 0)

    if a.plant_firing is not None and not 0 < a.plant_firing < 0.98:
        ap.error("--plant-firing must be in (0, 0.98)")
    if a.plant_rank is not None and (a.plant_firing is None or not 1 <= a.plant_rank < a.n_embd):
        ap.error("--plant-rank needs --plant-firing and must be in 1..n_embd-1")
    if a.plant_clusters is not None:
        if moe or a.plant_firing is not None:
            ap.error("--plant-clusters plants a dense FFN's co-activation: not with --experts or --plant-firing")
        if not 2 <= a.plant_clusters <= a.n_ff // 2:
            ap.error("--plant-clusters must be in 2..n_ff/2")
        if not 0 < a.cluster_share < 1:
            ap.error("--cluster-share must be in (0, 1)")
    if (a.head_dim is None and a.n_embd % a.n_head) or a.n_head % a.n_head_kv:
        ap.error("n_embd must be a multiple of n_head, and n_head of n_head_kv")
    head_dim = a.head_dim or a.n_embd // a.n_head
    wtype = quant.type_info(a.type)
    otype = quant.type_info(a.output_type or a.type)
    xtype = quant.type_info(a.expert_type or a.type)
    if a.expert_type and not moe:
        ap.error("--expert-type needs --experts")
    for t in {wtype, otype, xtype}:
        for n in (a.n_embd, a.n_ff, head_dim * a.n_head) + ((FFX,) + ((SH,) if SH else ()) if moe else ()):
            if n % t.block_size:
                ap.error(f"row length {n} is not a multiple of {t.block_size}, the block size of {t.name}")
    tok = donor_tokenizer(a.tokenizer_from)
    n_vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))

    gt = gguf.GGMLQuantizationType
    WT, OT, XT, F32 = gt(wtype.id), gt(otype.id), gt(xtype.id), gt.F32
    kv = a.n_head_kv * head_dim
    QD = a.n_head * head_dim
    E, FF = a.n_embd, a.n_ff

    # Normal values as table[random uint16]: the table holds the normal distribution's 65536 quantiles
    # (so values are normal, cut at +-4.3 std), three times faster than rng.standard_normal. One float32
    # buffer per shape is reused: write_gguf quantizes each tensor before asking for the next.
    nd = statistics.NormalDist(0.0, a.std)
    table = np.array([nd.inv_cdf((i + 0.5) / 65536) for i in range(65536)], dtype=np.float32)
    buffers: dict[tuple, np.ndarray] = {}

    def rand(shape, tensor_seed):
        def run():
            buf = buffers.get(shape)
            if buf is None:
                buf = buffers[shape] = np.empty(shape, dtype=np.float32)
            rng = np.random.default_rng([a.seed, tensor_seed])
            rows = buf.reshape(-1, shape[-1])
            step = max(1, (1 << 22) // shape[-1])
            for r in range(0, rows.shape[0], step):
                idx = rng.integers(0, 65536, (min(step, rows.shape[0] - r), shape[-1]), dtype=np.uint16)
                np.take(table, idx, out=rows[r : r + step])
            return buf
        return run

    def ones(n):
        return lambda: np.ones(n, dtype=np.float32)

    plant = a.plant_firing is not None or a.plant_experts is not None
    if plant:
        u = np.random.default_rng([a.seed, 7]).standard_normal(E).astype(np.float32)
        u /= np.linalg.norm(u)
        emb_scale = 1.0 / a.std  # embeddings of std 1 (the layers' outputs are small beside them)
    if a.plant_firing is not None:
        firing = power_law_firing(FF, a.plant_firing)
        # x_n = a_u u + r after RMSNorm with |a_u| = |r| = sqrt(E / 2). Gate row j is g_j (its u component
        # removed) + beta_j u, so gate_j . x_n = g_j . r + beta_j a_u with g_j . r ~ N(0, std^2 E / 2) over
        # tokens: P(fire) = Phi(beta_j / std), i.e. beta_j = std * Phi^-1(p_j).
        norm = statistics.NormalDist()
        beta_of = np.array([norm.inv_cdf(float(p)) for p in firing], dtype=np.float32) * a.std
        if a.plant_rank is not None:  # an orthonormal basis of the subspace, orthogonal to u
            q = np.random.default_rng([a.seed, 17]).standard_normal((E, a.plant_rank)).astype(np.float32)
            q -= u[:, None] * (u @ q)[None, :]
            q = np.linalg.qr(q)[0].astype(np.float32)
            q_spread = q.T * np.float32(np.sqrt(E / a.plant_rank))  # back to the full space, at the planted spread

    def scaled(make, factor):
        def run():
            return make() * np.float32(factor)
        return run

    def embedding(make):
        def run():  # random part of std 1 plus the common component, as large: sqrt(E) * u
            x = make() * np.float32(emb_scale)
            x += np.float32(np.sqrt(E)) * u
            return x
        return run

    def planted_gate(make, layer):
        def run():
            g = make()
            if a.plant_rank is not None:  # the same spread over tokens, from R coordinates of the input
                g = (g @ q) @ q_spread
            beta = beta_of[np.random.default_rng([a.seed, 11, layer]).permutation(FF)]
            g += (beta - g @ u)[:, None] * u[None, :]
            return g
        return run

    def planted_router(make, layer):
        # The router row of the rank-r expert gets beta_r u on top of its random part: gate_inp . x_n then
        # carries beta_r a_u (a_u = sqrt(E / 2), see above) beside noise of std router_std * sqrt(E / 2),
        # so a popular expert's logit sits log(1 / p_r)-ish above the others'; beta falls as
        # ALPHA * log(r + 1), a power law of exponent ALPHA in the softmax's terms.
        def run():
            g = make()
            rank = np.random.default_rng([a.seed, 13, layer]).permutation(a.experts)
            beta = -a.plant_experts * np.log1p(rank.astype(np.float32)) / np.float32(np.sqrt(E / 2))
            g += (beta - g @ u)[:, None] * u[None, :]
            return g
        return run

    RSTD = (a.router_std or a.std) / a.std

    def clustered(make, layer, which):
        def run():
            g = make()
            of, d = cluster_layout(a.seed, layer, FF, a.plant_clusters, E, which)
            w = np.float32(a.cluster_share)
            g *= np.sqrt(1 - w)
            g += (np.sqrt(w) * a.std * np.sqrt(E)) * d[of]
            return g
        return run

    def ffn_rows(make, layer, which):
        if a.plant_clusters is not None:
            return clustered(make, layer, which)
        if which == 0 and a.plant_firing is not None:
            return planted_gate(make, layer)
        return make

    # (name, numpy shape = (rows, cols) with cols the row length, type, compute)
    emb = rand((n_vocab, E), 1_000_000)
    tensors = [("token_embd.weight", (n_vocab, E), OT, embedding(emb) if plant else emb)]
    for il in range(a.n_layer):
        p = f"blk.{il}."
        s = 1000 * (il + 1)
        tensors += [
            (p + "attn_norm.weight", (E,), F32, ones(E)),
            (p + "attn_q.weight", (QD, E), WT, rand((QD, E), s + 1)),
            (p + "attn_k.weight", (kv, E), WT, rand((kv, E), s + 2)),
            (p + "attn_v.weight", (kv, E), WT, rand((kv, E), s + 3)),
            (p + "attn_output.weight", (E, QD), WT,
             scaled(rand((E, QD), s + 4), 0.1) if plant else rand((E, QD), s + 4)),
            (p + ("post_attention_norm.weight" if oss else "ffn_norm.weight"), (E,), F32, ones(E)),
        ]
        if oss:
            tensors += [(p + "attn_q.bias", (QD,), F32, rand((QD,), s + 11)),
                        (p + "attn_k.bias", (kv,), F32, rand((kv,), s + 12)),
                        (p + "attn_v.bias", (kv,), F32, rand((kv,), s + 13)),
                        (p + "attn_output.bias", (E,), F32, rand((E,), s + 17)),
                        (p + "attn_sinks.weight", (a.n_head,), F32, scaled(rand((a.n_head,), s + 18), 1 / a.std))]
        if a.arch in ("qwen3", "qwen3moe"):
            tensors += [(p + "attn_q_norm.weight", (head_dim,), F32, ones(head_dim)),
                        (p + "attn_k_norm.weight", (head_dim,), F32, ones(head_dim))]
        if a.arch == "qwen2moe":
            tensors += [(p + "attn_q.bias", (QD,), F32, rand((QD,), s + 11)),
                        (p + "attn_k.bias", (kv,), F32, rand((kv,), s + 12)),
                        (p + "attn_v.bias", (kv,), F32, rand((kv,), s + 13))]
        if not moe:
            tensors += [
                (p + "ffn_gate.weight", (FF, E), WT, ffn_rows(rand((FF, E), s + 5), il, 0)),
                (p + "ffn_up.weight", (FF, E), WT, ffn_rows(rand((FF, E), s + 6), il, 1)),
                (p + "ffn_down.weight", (E, FF), WT,
                 scaled(rand((E, FF), s + 7), 0.1) if plant else rand((E, FF), s + 7)),
            ]
            continue
        X = a.experts
        router = scaled(rand((X, E), s + 8), RSTD)
        tensors += [
            (p + "ffn_gate_inp.weight", (X, E), F32,
             planted_router(router, il) if a.plant_experts is not None else router),
            (p + "ffn_gate_exps.weight", (X, FFX, E), XT, rand((X, FFX, E), s + 5)),
            (p + "ffn_up_exps.weight", (X, FFX, E), XT, rand((X, FFX, E), s + 6)),
            (p + "ffn_down_exps.weight", (X, E, FFX), XT,
             scaled(rand((X, E, FFX), s + 7), 0.1) if plant else rand((X, E, FFX), s + 7)),
        ]
        if oss:
            tensors += [(p + "ffn_gate_inp.bias", (X,), F32, rand((X,), s + 19)),
                        (p + "ffn_gate_exps.bias", (X, FFX), F32, rand((X, FFX), s + 20)),
                        (p + "ffn_up_exps.bias", (X, FFX), F32, rand((X, FFX), s + 21)),
                        (p + "ffn_down_exps.bias", (X, E), F32, rand((X, E), s + 22))]
        if SH:
            tensors += [
                (p + "ffn_gate_inp_shexp.weight", (E,), F32, rand((E,), s + 9)),
                (p + "ffn_gate_shexp.weight", (SH, E), WT, rand((SH, E), s + 14)),
                (p + "ffn_up_shexp.weight", (SH, E), WT, rand((SH, E), s + 15)),
                (p + "ffn_down_shexp.weight", (E, SH), WT,
                 scaled(rand((E, SH), s + 16), 0.1) if plant else rand((E, SH), s + 16)),
            ]
    tensors += [
        ("output_norm.weight", (E,), F32, ones(E)),
        ("output.weight", (n_vocab, E), OT, rand((n_vocab, E), 2_000_000)),
    ]
    n_params = sum(int(np.prod(s)) for _, s, _, _ in tensors)
    size_label = f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.0f}M"

    def add_metadata(w: gguf.GGUFWriter) -> None:
        w.add_type("model")
        w.add_name(f"synthetic-{a.arch}-{size_label}-{a.activation}-{wtype.name.lower()}")
        w.add_size_label(size_label)
        w.add_description(f"random weights (normal, std {a.std}, seed {a.seed}"
                          + (f", planted power-law FFN firing of mean {a.plant_firing}" if a.plant_firing is not None else "")
                          + (f", {a.experts} experts ({a.experts_used} used) of popularity planted with exponent "
                             f"{a.plant_experts}" if a.plant_experts is not None else "")
                          + (f", FFN neurons in co-active clusters of {a.plant_clusters} (share {a.cluster_share})"
                             if a.plant_clusters is not None else "")
                          + ") written by tools/make_synthetic_model.py for speed benchmarks; not a language model")
        w.add_context_length(a.n_ctx_train)
        w.add_embedding_length(E)
        w.add_block_count(a.n_layer)
        w.add_feed_forward_length(FF)
        w.add_head_count(a.n_head)
        w.add_head_count_kv(a.n_head_kv)
        w.add_rope_dimension_count(head_dim)
        if a.head_dim:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if moe:
            w.add_expert_count(a.experts)
            w.add_expert_used_count(a.experts_used)
            if a.arch != "llama":  # Mixtral's experts are feed_forward_length wide
                w.add_expert_feed_forward_length(FFX)
            if SH:
                w.add_expert_shared_feed_forward_length(SH)
        if oss:
            w.add_sliding_window(a.sliding_window)
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(32.0)
            w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_freq_base(150000.0 if oss else 10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(n_vocab)
        ftype = "mxfp4" if xtype.name == "MXFP4" else wtype.name.lower()  # llama.cpp's MXFP4_MOE: MXFP4 experts
        if ftype in _FTYPE:
            w.add_file_type(_FTYPE[ftype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if a.activation != "silu":
            w.add_string("optiml.ffn.activation", a.activation)
        for key, val, vtype, sub in tok:
            w.add_key_value(key, val, vtype, sub)

    t0 = time.perf_counter()
    writer.write_gguf(a.out, a.arch, add_metadata, tensors, progress=not a.quiet)
    dt = time.perf_counter() - t0
    size = os.path.getsize(a.out)
    print(f"{a.out}: {a.arch}, {size_label} parameters ({n_params:,}), {a.n_layer} layers, n_embd {E}, "
          + (f"{a.experts} {xtype.name} experts of {FFX} ({a.experts_used} used, shared {SH}), " if moe
             else f"n_ff {FF}, ") +
          f"{a.n_head}/{a.n_head_kv} heads, vocab {n_vocab}, {wtype.name} ({otype.name} embeddings/output), "
          f"activation {a.activation}; {size / 2**30:.2f} GiB written in {dt:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
