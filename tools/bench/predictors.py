#!/usr/bin/env python3
"""Activation predictors (issue 15): speed on 7B-shaped models beside llama.cpp dense, and quality on real
models, in one run per part (--only speed | quality | train).

speed    7B-shaped llama, random Q4_0 weights (tools/make_synthetic_model.py; ReLU and SwiGLU files in
         --model-dir, written when missing). Random weights have no natural sparsity and no predictable
         neurons, so the predicted sparsity is FORCED: a predictor file of rank --rank (default 256, Q8_0:
         the same bytes and work as a trained one of that rank) with random Gaussian A [rank x n_embd] (std
         1/sqrt(n_embd)) and B [n_ff x rank] (std 1/sqrt(rank)), so each score is about N(0, 1) on the
         RMS-normed FFN input, and threshold Phi^-1(s) marks about 1 - s of the neurons active, a different
         set every token. The measured share of computed neurons is printed beside each row. ReLU rows keep
         exact zero-skipping on top (down only for predicted neurons whose relu(gate) > 0: about half).
         Generation speed as tools/bench/sparse.py times it (teacher-forced text tokens one at a time,
         OptiML and llama-cpp-python alternating, medians; --threads 2). Beside each row, the read-only
         speed: that of a step that only read its weights, in the engine's pattern, at rates measured
         then (scattered rows read slower than sequential ones on many machines).
quality  SmolLM2-135M-Instruct Q4_1 (SiLU) and Gemma 3 270M Q4_K_M (GELU). For each level s in --levels,
         predictors are trained (optiml.train_predictors, recall --recall) on the first half of the shared
         eval text with labels "|act(gate) * up| above the level-s quantile", then measured on the second
         half: recall / precision of the masks per layer (mean, min), perplexity and KL divergence against
         the dense model (optiml.perplexity, the engine behind `optiml perplexity --kl-divergence`; ctx 256),
         and generation speed with predictors against OptiML dense. Writes a plot (--plot; needs matplotlib,
         the `plot` extra) of KLD against speed.
train    Times `optiml train-predictors` on the 7B-shaped ReLU file with --train-samples tokens (default 512)
         and extrapolates to 4096 samples (sampling is linear in tokens; the per-layer fit is measured).

    PYTHONPATH=python python tools/bench/predictors.py --only speed --model-dir /work/synth
    PYTHONPATH=python python tools/bench/predictors.py --only quality --plot predictors.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import harness
import optiml
from harness import alternate_tg_text, close, computed_share, log, noisy, spread

models = harness.internal("models")
P = harness.internal("predictor")
model_fingerprint = harness.internal("stats").model_fingerprint

SMOLLM2 = harness.model_path("smollm2-135m-instruct-q4_1")
GEMMA3 = harness.model_path("gemma3-270m-q4_k_m")
RESULTS = harness.Results("predictors")  # the speed and quality tables' rows, for --json
GOALS = {"relu": (0.9, 2.3), "silu": (0.5, 1.4)}


def forced_predictor(model_path: str, out: str, sparsity: float, rank: int, seed: int = 0) -> str:
    hp = optiml._core.Model(model_path).hparams
    L, E, F = hp["n_layer"], hp["n_embd"], hp["n_ff"]
    rng = np.random.default_rng(seed)
    t = statistics.NormalDist().inv_cdf(sparsity)
    res = P.PredictorTraining(np.full(L, rank, np.int32), np.full(L, t, np.float32), np.zeros(L, np.float32),
                              np.full(L, 1 - sparsity, np.float32), np.zeros(L, np.float32), np.zeros(L, np.float32),
                              0.0, 0, "q8_0")
    layers = [(rng.standard_normal((rank, E), dtype=np.float32) / np.sqrt(E),
               rng.standard_normal((F, rank), dtype=np.float32) / np.sqrt(rank), np.zeros(F, np.float32))
              for _ in range(L)]
    harness.internal("predictor_file").write(out, layers, res, model_path, model_fingerprint(model_path), hp)
    return out


def weight_bytes(path: str) -> dict:
    """Bytes of each tensor of a GGUF file."""
    import gguf

    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}


def bytes_per_token(model: dict, pred: dict | None, share: float, down_share: float) -> float:
    """The fewest weight bytes a decode step can read: every tensor but the token embeddings (one row; the
    logits read the matrix when the output is tied to it), FFN gate/up at the computed share and down at
    down_share in the file's own format, and the predictor's tensors. A dense step (share 1, no predictor)
    is what llama.cpp reads. Dividing the two bounds the speed-up on a machine whose steps are limited by
    memory bandwidth, as 7B decoding is."""
    total = sum(v for k, v in model.items() if k != "token_embd.weight")
    if "output.weight" not in model:
        total += model["token_embd.weight"]
    gate_up, down = ffn_bytes(model)
    return total - (1 - share) * gate_up - (1 - down_share) * down + (sum(pred.values()) if pred else 0)


def ffn_bytes(model: dict) -> tuple[int, int]:
    """Bytes of all layers' FFN gate and up matrices together, and of their down matrices."""
    gate_up = sum(v for k, v in model.items() if k.endswith(("ffn_gate.weight", "ffn_up.weight")))
    return gate_up, sum(v for k, v in model.items() if k.endswith("ffn_down.weight"))


def read_only_speed(model: dict, need: float, share: float, down_share: float, row_bytes: int, threads: int) -> float:
    """Tokens per second if a step did nothing but read its weights in the engine's pattern, at rates
    measured now (this host's speed drifts, so right beside the timed runs): the FFN rows a share of
    the gate/up rows and a down_share of the down rows, each a random set of rows in ascending order
    (optiml._core.measure_scattered_read_bandwidth), the rest sequentially. Scattered rows of a few KiB
    read well below the sequential rate on many machines. An estimate, not a bound: long read-only passes
    and the engine's short bursts do not see quite the same memory system."""
    from optiml import _core

    seq = _core.measure_read_bandwidth(1 << 30, 3, threads)
    gate_up, down = ffn_bytes(model)
    rows = {share: share * gate_up}
    rows[down_share] = rows.get(down_share, 0.0) + down_share * down
    t = (need - sum(rows.values())) / seq
    for s, b in rows.items():
        t += b / (seq if s >= 1.0 else _core.measure_scattered_read_bandwidth(row_bytes, s, 1 << 30, 3, threads))
    return 1.0 / t


def bench_speed(a, act: str) -> list[str]:
    path = harness.synthetic_7b(a.model_dir, act)
    text = open(harness.TEXT, encoding="utf-8").read()
    n_prompt, n_gen = a.n_prompt, a.n_gen
    n_ctx = n_prompt + n_gen + 8
    peer = harness.load_peer(path, n_ctx, a.threads)
    ours = optiml.Model(path, n_ctx=n_ctx, n_threads=a.threads, sparsity="none", predictors=None)
    ids = ours.tokenize(text[len(text) // 2:], add_bos=False)
    rows = []
    model_bytes = weight_bytes(path)
    dense_bytes = bytes_per_token(model_bytes, None, 1.0, 1.0)
    hp = ours.hparams
    row_bytes = model_bytes["blk.0.ffn_gate.weight"] // hp["n_ff"]  # one neuron's gate row in the file
    o, p = alternate_tg_text(ours, peer, ids, n_prompt, n_gen, a.repeats)
    rows.append(("dense", 1.0, o, p, dense_bytes, read_only_speed(model_bytes, dense_bytes, 1.0, 1.0, row_bytes, a.threads)))
    log(f"7B {act} dense: optiml {[round(x, 2) for x in o]}, llama.cpp {[round(x, 2) for x in p]}")
    close(ours)
    tmp = tempfile.mkdtemp(prefix="optiml-pred-")
    for s in a.levels_speed:
        pred = forced_predictor(path, os.path.join(tmp, f"p{s}.gguf"), s, a.rank)
        for copy in a.down_copies:
            m = optiml.Model(path, n_ctx=n_ctx, n_threads=a.threads, predictors=pred, down_copy=copy)
            o, p = alternate_tg_text(m, peer, ids, n_prompt, n_gen, a.repeats)
            share = computed_share(m, ids, n_prompt)
            name = f"{s:.0%} predicted" + (f", {copy} down" if a.down_copies != ["auto"] else "")
            log(f"7B {act} {name}: computed {share:.3f}, optiml {[round(x, 2) for x in o]}, "
                f"llama.cpp {[round(x, 2) for x in p]}")
            # Random symmetric weights: relu(gate) > 0 for half of the predicted neurons, and only those
            # reach the down projection (exact zero-skipping).
            down_share = share / 2 if act == "relu" else share
            need = bytes_per_token(model_bytes, weight_bytes(pred), share, down_share)
            rows.append((name, share, o, p, need, read_only_speed(model_bytes, need, share, down_share, row_bytes, a.threads)))
            close(m)
        os.unlink(pred)
    close(peer)
    label = {"relu": "ReLU (llama.cpp runs SiLU on it: the same work)", "silu": "SwiGLU"}[act]
    out = [f"### 7B-shaped llama, random Q4_0 weights, {label}, {a.threads} threads, forced predictor rank {a.rank}",
           f"tg: {n_gen} text tokens after {n_prompt}, median (range) of {a.repeats}", "",
           "| FFN | gate/up rows computed | optiml tok/s | llama.cpp dense tok/s | ratio | vs optiml dense | "
           "weights read per token (MB) | bandwidth ceiling of the ratio | ratio / ceiling | read-only tok/s "
           "(ratio) | optiml / read-only |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    od = statistics.median(rows[0][2])
    for name, share, o, p, need, ro in rows:
        r = statistics.median(o) / statistics.median(p)
        ceiling = dense_bytes / need
        RESULTS.add(table="speed", activation=act, ffn=name, computed=share, optiml=statistics.median(o), optiml_runs=o,
                    llama_cpp=statistics.median(p), llama_cpp_runs=p, ratio=r, vs_dense=statistics.median(o) / od,
                    mb_per_token=need / 1e6, ceiling=ceiling, read_only=ro)
        out.append(f"| {name} | {share:.3f} | {spread(o, '.2f')} | {spread(p, '.2f')} | "
                   f"{r:.2f}x{' (noisy)' if noisy(o, p) else ''} | {statistics.median(o) / od:.2f}x | "
                   f"{need / 1e6:.0f} | {ceiling:.2f}x | {r / ceiling:.2f} | {ro:.2f} "
                   f"({ro / statistics.median(p):.2f}x) | {statistics.median(o) / ro:.2f} |")
    out += ["", "ceiling: llama.cpp's dense bytes / the fewest bytes the sparse step reads (file formats; ReLU: "
            "down for the half of the predicted neurons that fire), the ratio both would reach at equal "
            "bandwidth",
            f"read-only: the speed of a step that read its weights and computed nothing, measured beside the row: the FFN "
            f"rows as a random share of {row_bytes}-byte rows in ascending order, the rest sequentially "
            "(optiml._core.measure_scattered_read_bandwidth, measure_read_bandwidth); in brackets against "
            "llama.cpp's median"]
    gs, gr = GOALS[act]
    hit = [r for r in rows if r[0].split(",")[0] == f"{gs:.0%} predicted"]
    if hit:
        out.append("")
    for h in hit:
        r = statistics.median(h[2]) / statistics.median(h[3])
        out.append(f"goal: {h[0]} >= {gr}x llama.cpp dense -> {r:.2f}x ({'met' if r >= gr else 'NOT met'})")
    return out


def bench_quality(a) -> tuple[list[str], list]:
    px = harness.internal("perplexity")
    text = open(harness.TEXT, encoding="utf-8").read()
    train, test = text[: len(text) // 2], text[len(text) // 2:]
    out, curves = [], []
    tmp = tempfile.mkdtemp(prefix="optiml-predq-")
    for name, path in (("SmolLM2-135M Q4_1", SMOLLM2), ("Gemma3-270M Q4_K_M", GEMMA3)):
        if not os.path.exists(path):
            out.append(f"{name}: {path} missing (python tools/fetch_models.py)")
            continue
        dense = optiml.Model(path, n_ctx=a.ctx, n_threads=a.threads, sparsity="none", predictors=None)
        base_path = os.path.join(tmp, "base.kld")
        px.save_base(base_path, dense, test, a.ctx, a.chunks)
        base = px.read_base(base_path)
        ids = dense.tokenize(test, add_bos=False)
        out += [f"### {name}: predictors trained on the first half of the eval text, measured on the second "
                f"(recall target {a.recall}; ctx {a.ctx}, {a.chunks} windows; {a.threads} threads)", "",
                "| label sparsity | rank (mean) | recall mean/min | precision | computed | PPL (dense) | KLD mean | "
                "same top | tok/s vs OptiML dense |", "|---|---|---|---|---|---|---|---|---|"]
        curve = []
        for s in a.levels:
            pred = os.path.join(tmp, f"p{s}.gguf")
            t0 = time.perf_counter()
            res = P.train_predictors(path, texts=[train], recall=a.recall, out=pred, samples=a.samples,
                                     label_sparsity=s, max_rank=a.max_rank, progress=False, n_threads=a.threads)
            q = P.mask_quality(path, pred, texts=[test], n_tokens=1024)
            m = optiml.Model(path, n_ctx=a.ctx, n_threads=a.threads, sparsity="none", predictors=pred)
            r = px.compare(base, m).summary()
            share = computed_share(m, ids, 16)
            o, d = alternate_tg_text(m, dense, ids, 16, a.n_gen_small, a.repeats)
            ratio = statistics.median(o) / statistics.median(d)
            log(f"{name} level {s}: trained in {time.perf_counter() - t0:.0f} s, recall {q['recall_all']:.4f}, "
                f"KLD {r['kld_mean']:.4f}, computed {share:.3f}, speed {ratio:.2f}x")
            out.append(f"| {s:.0%} | {res.rank.mean():.0f} | {q['recall'].mean():.4f} / {q['recall'].min():.4f} | "
                       f"{q['precision'].mean():.3f} | {share:.3f} | {r['ppl']:.3f} ({r['ppl_base']:.3f}) | "
                       f"{r['kld_mean']:.4f} | {r['same_top']:.3f} | {ratio:.2f}x{' (noisy)' if noisy(o, d) else ''} |")
            curve.append((s, share, r["kld_mean"], r["ppl_ratio"], ratio))
            RESULTS.add(table="quality", model=name, label_sparsity=s, rank_mean=float(res.rank.mean()),
                        recall_mean=float(q["recall"].mean()), recall_min=float(q["recall"].min()),
                        precision=float(q["precision"].mean()), computed=share, ppl=r["ppl"], ppl_dense=r["ppl_base"],
                        kld_mean=r["kld_mean"], same_top=r["same_top"], vs_dense=ratio, noisy=noisy(o, d))
            close(m)
        ok = [c for c in curve if c[2] < 0.05 and c[3] < 1.03]
        if ok:
            c = max(ok, key=lambda c: c[0])
            out += ["", f"highest level with KLD < 0.05 and PPL within 3%: {c[0]:.0%} (computed {c[1]:.3f}), "
                        f"{c[4]:.2f}x OptiML dense"]
        else:
            out += ["", "no level kept KLD < 0.05 and PPL within 3%"]
        out.append("")
        curves.append((name, curve))
        close(dense)
    return out, curves


def plot(curves, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves:
        ax.plot([x[4] for x in c], [x[2] for x in c], "o-", label=name)
        for x in c:
            ax.annotate(f"{x[0]:.0%}", (x[4], x[2]), fontsize=7)
    ax.axhline(0.05, ls="--", c="gray", lw=0.8)
    ax.set_xlabel("generation speed / OptiML dense")
    ax.set_ylabel("KL divergence vs dense (mean)")
    ax.set_yscale("log")
    ax.set_title("Activation predictors: speed vs quality")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench_train(a) -> list[str]:
    path = harness.synthetic_7b(a.model_dir, "relu")
    text = open(harness.TEXT, encoding="utf-8").read()
    import resource

    res = P.train_predictors(path, texts=[text], recall=0.99, samples=a.train_samples, max_rank=a.max_rank_7b,
                             progress=True, n_threads=a.threads)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    s, t = res.seconds["samples_s"], res.seconds["train_s"]
    est = s * 4096 / a.train_samples + t * (4096 / a.train_samples)  # the fit is at most linear in samples
    return [f"### train-predictors on the 7B-shaped ReLU file, {a.train_samples} samples, max rank {a.max_rank_7b}",
            f"sampling {s:.0f} s, fitting 32 layers {t:.0f} s, peak RSS {rss:.1f} GiB; ranks chosen "
            f"{sorted(set(res.rank.tolist()))}",
            f"extrapolated to 4096 samples (linear in samples, an upper bound for the fit): {est / 60:.1f} min"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("speed", "quality", "train"), action="append")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--model-dir", default=str(models.cache_dir() / "synthetic"),
                    help="where the 7B-shaped files are written and kept (default: the model cache's synthetic/)")
    ap.add_argument("--acts", nargs="+", default=["relu", "silu"])
    ap.add_argument("--levels-speed", type=float, nargs="+", default=[0.5, 0.8, 0.9])
    ap.add_argument("--down-copies", nargs="+", default=["auto"], choices=["auto", "fast", "compact"],
                    help="speed: the sparse FFN's down copy (Model(down_copy=...)), a row per copy and level")
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--n-prompt", type=int, default=16)
    ap.add_argument("--n-gen", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--recall", type=float, default=0.99)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--max-rank", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--n-gen-small", type=int, default=64)
    ap.add_argument("--plot", default="predictors.png")
    ap.add_argument("--train-samples", type=int, default=512)
    ap.add_argument("--max-rank-7b", type=int, default=1024)
    harness.add_json_arg(ap)
    a = ap.parse_args(argv)
    bad = [s for s in a.levels_speed + a.levels if not 0.0 < s < 1.0]
    if bad:
        ap.error(f"sparsity levels are fractions between 0 and 1 (0.9 for 90%), got {bad}")
    parts = a.only or ["speed", "quality"]
    harness.llama_cpp()  # exits with how to install it when missing
    report = [harness.machine_line() + f", optiml {optiml.__version__}, {a.threads} threads", ""]
    if "speed" in parts:
        for act in a.acts:
            report += bench_speed(a, act) + [""]
    if "quality" in parts:
        lines, curves = bench_quality(a)
        report += lines
        if a.plot and curves:
            plot(curves, a.plot)
            report.append(f"plot: {a.plot}")
    if "train" in parts:
        report += bench_train(a)
    print("\n".join(report))
    RESULTS.write(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
