#!/usr/bin/env python3
"""Co-active neurons side by side (issue 45): a 7B-shaped SwiGLU model whose FFN neurons fire in planted
clusters, decoded with predictors at 50% in the file's order, in the co-activation order `optiml solve`
finds, and by groups, beside llama.cpp dense and OptiML dense in the same run.

The model: tools/make_synthetic_model.py --plant-clusters C (random Q4_0 weights; each layer's neurons in
clusters of C scattered through the file, every cluster's gate and up rows sharing a direction, so its
neurons see nearly the same values and fire together). The pipeline is the user's:
    optiml profile --samples N   the firing masks of N tokens
    optiml solve --vram 0 --order coactive   the CPU's neurons in co-activation order (a neuron_order
                                             file: Q4_0 down columns cannot move exactly, so the CPU reads
                                             a copy of its layers in that order, made at load)
The predictor is FORCED from the planted structure (as tools/bench/predictors.py forces its own; random
weights have nothing to learn from text): rank n_clusters (padded to a multiple of 32), A the clusters'
gate directions, B each neuron's cluster, threshold 0: a cluster is predicted active when its gate is
positive for the token, about half of them (printed as "computed"). It is the predictor a perfect training
would give; its speed (bytes and work) is that of a trained one of the same rank.

Rows (decode, teacher-forced text tokens one at a time after a prompt; each OptiML setting alternated
with llama.cpp on the same file, medians):
    dense             OptiML without predictors
    file order        predictors, the rows in the file's order (a step reads clusters scattered)
    co-active         predictors, the placed file: a copy of each layer in co-activation order
    co-active, g=G    the same predicting by groups of G placed neurons (--groups)
Then the two orders alternated with each other (the order's own effect, side by side). Beside each row: the
mean run of consecutive rows a step reads (from the profile's held-out sampled FFN
inputs, the forced predictor's masks) and the speed against llama.cpp and OptiML dense.

--quality does the same on SmolLM2-135M and Gemma 3 270M (real models, real text) with predictors TRAINED
(optiml.train_predictors, label sparsity 0.5, recall --recall, default 0.99) on the first half of the eval text, which the
profile also reads; measured on the second half: KL divergence against the dense model, the share of gate/up
rows computed, the mean run of active rows (the profile's held-out masks, hot-first vs co-activation order)
and decode speed against OptiML dense, for the file's order, the co-activation order, and groups of G.

    PYTHONPATH=python python tools/bench/coactive.py --threads 2 --repeats 5
    PYTHONPATH=python python tools/bench/coactive.py --quality --groups 8 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

import harness
import optiml
from harness import alternate_tg_text, close, computed_share, log, noisy, spread

sys.path.insert(0, str(harness.ROOT / "tools"))
from make_synthetic_model import cluster_layout  # noqa: E402

models = harness.internal("models")
P = harness.internal("predictor")
stats_mod = harness.internal("stats")
model_fingerprint = stats_mod.model_fingerprint
coactive = harness.internal("coactive")
GOAL = 1.6  # llama.cpp dense, 4 runs in 5


def cluster_predictor(model_path: str, out: str, size: int) -> tuple[str, list]:
    """The forced predictor of a --plant-clusters model (see the module doc) and each layer's clusters
    (neuron -> cluster, gate directions)."""
    hp = optiml._core.Model(model_path).hparams
    L, E, F = hp["n_layer"], hp["n_embd"], hp["n_ff"]
    layout = [cluster_layout(0, l, F, size, E) for l in range(L)]
    n_cl = F // size
    rank = -(-n_cl // 32) * 32
    res = P.PredictorTraining(np.full(L, rank, np.int32), np.zeros(L, np.float32), np.zeros(L, np.float32),
                              np.full(L, 0.5, np.float32), np.zeros(L, np.float32), np.zeros(L, np.float32),
                              0.0, 0, "q8_0")
    layers = []
    for of, d in layout:
        a = np.zeros((rank, E), np.float32)
        a[:n_cl] = d
        b = np.zeros((F, rank), np.float32)
        b[np.arange(F), of] = 1.0
        layers.append((a, b, np.zeros(F, np.float32)))
    harness.internal("predictor_file").write(out, layers, res, model_path, model_fingerprint(model_path), hp)
    return out, layout


def mean_run(masks: np.ndarray, order: np.ndarray, group: int) -> float:
    """The mean run of consecutive rows a step reads: masks [S, F] in file order, rows stored in `order`,
    groups of `group` placed rows read whole when any member is predicted."""
    m = masks[:, order]
    if group > 1:
        S, F = m.shape
        pad = (-F) % group
        g = np.pad(m, ((0, 0), (0, pad))).reshape(S, -1, group).any(axis=2)
        m = np.repeat(g, group, axis=1)[:, :F]
    return coactive.run_lengths(m, np.arange(m.shape[1]))


def run_optiml(a, path: str, pred: str | None, group: int, peer, ids, n_ctx: int):
    m = optiml.Model(path, n_ctx=n_ctx, n_threads=a.threads, sparsity="none", predictors=pred,
                     predictor_group=group)
    copy = m.placed_copy_info()
    o, p = alternate_tg_text(m, peer, ids, a.n_prompt, a.n_gen, a.repeats)
    share = computed_share(m, ids, a.n_prompt) if pred else None
    close(m)
    return o, p, share, copy


def cli(*args) -> str:
    """Runs `python -m optiml ARGS`; its output, or exit showing its stderr when it fails."""
    r = subprocess.run([sys.executable, "-m", "optiml", *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"optiml {args[0]} failed ({r.returncode}):\n{r.stderr}")
    return r.stdout


def bench_quality(a, results) -> None:
    """Real models, trained predictors: see the module doc."""
    px = harness.internal("perplexity")
    text = open(harness.TEXT, encoding="utf-8").read()
    train, test = text[: len(text) // 2], text[len(text) // 2:]
    tmp = tempfile.mkdtemp(prefix="optiml-coactive-")
    with open(os.path.join(tmp, "train.txt"), "w", encoding="utf-8") as f:
        f.write(train)
    for name, reg in (("SmolLM2-135M Q4_1", "smollm2-135m-instruct-q4_1"), ("Gemma3-270M Q4_K_M", "gemma3-270m-q4_k_m")):
        path = harness.model_path(reg)
        if not os.path.exists(path):
            print(f"{name}: {path} missing (python tools/fetch_models.py)")
            continue
        stats, placed, pred = (os.path.join(tmp, f"{reg}.{x}") for x in ("npz", "placed.gguf", "pred.gguf"))
        log(f"{name}: profile, solve, train")
        cli("profile", "-m", path, "--data", os.path.join(tmp, "train.txt"), "--tokens", "4096", "--samples", "2048",
            "-t", str(a.threads), "-o", stats)
        solved = cli("solve", "-m", path, "--stats", stats, "--vram", "0", "--order", "coactive", "-o", placed)
        runs = next((ln for ln in solved.splitlines() if ln.startswith("co-activation order")), "")
        P.train_predictors(path, texts=[train], recall=a.recall, out=pred, label_sparsity=0.5, progress=False,
                           n_threads=a.threads)
        dense = optiml.Model(path, n_ctx=256, n_threads=a.threads, sparsity="none", predictors=None)
        base_path = os.path.join(tmp, f"{reg}.kld")
        px.save_base(base_path, dense, test, 256, 8)
        base = px.read_base(base_path)
        ids = dense.tokenize(test, add_bos=False)
        print(f"\n### {name}: predictors trained at label sparsity 0.5, recall {a.recall}; KLD over 8 windows of 256 "
              f"of held-out text; {a.threads} threads\n{runs}\n")
        print("| FFN | gate/up rows computed | KLD mean | same top | tok/s vs OptiML dense |")
        print("|---|---|---|---|---|")
        for label, p_, g in [("file order", path, 1)] + [("co-active" + (f", g={g}" if g > 1 else ""), placed, g)
                                                         for g in [1] + a.groups]:
            m = optiml.Model(p_, n_ctx=256, n_threads=a.threads, sparsity="none", predictors=pred, predictor_group=g)
            r = px.compare(base, m).summary()
            share = computed_share(m, ids, 16, 32)
            o, d = alternate_tg_text(m, dense, ids, 16, 64, a.repeats)
            ratio = statistics.median(o) / statistics.median(d)
            results.add(table="quality", model=name, ffn=label, computed=share, kld_mean=r["kld_mean"],
                        same_top=r["same_top"], vs_dense=ratio, optiml_runs=o, dense_runs=d)
            print(f"| {label} | {share:.3f} | {r['kld_mean']:.4f} | {r['same_top']:.3f} | "
                  f"{ratio:.2f}x{' (noisy)' if noisy(o, d) else ''} |", flush=True)
            close(m)
        close(dense)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--model-dir", default=str(models.cache_dir() / "synthetic"))
    ap.add_argument("--cluster", type=int, default=64, help="planted cluster size (default 64)")
    ap.add_argument("--groups", type=int, nargs="*", default=[64], help="group sizes to predict by")
    ap.add_argument("--samples", type=int, default=1024, help="tokens profiled, each kept as a sample")
    ap.add_argument("--n-prompt", type=int, default=16)
    ap.add_argument("--n-gen", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a 4-layer 512-wide model instead of 7B (a smoke test)")
    ap.add_argument("--quality", action="store_true", help="SmolLM2 and Gemma 3 with trained predictors instead")
    ap.add_argument("--recall", type=float, default=0.99, help="--quality: the predictors' recall target")
    a, results = harness.parse(ap, "coactive", argv)
    if a.quality:
        bench_quality(a, results)
        results.write(a.json)
        return 0

    shape = ["--n-embd", "512", "--n-layer", "4", "--n-ff", "2048", "--n-head", "8", "--n-head-kv", "8"] if a.tiny else []
    path = harness.synthetic_model(os.path.join(a.model_dir, f"{'tiny' if a.tiny else 'llama7b'}-silu-clusters"
                                                             f"{a.cluster}-q4_0.gguf"),
                                   "--plant-clusters", str(a.cluster), *shape)
    base = os.path.splitext(path)[0]
    stats_path, placed = base + ".stats.npz", base + ".coactive.gguf"
    if not os.path.exists(stats_path):
        log(f"profiling {a.samples} tokens")
        cli("profile", "-m", path, "--data", str(harness.TEXT), "--tokens", str(a.samples), "--samples",
            str(a.samples), "-t", str(a.threads), "-o", stats_path)
    if not os.path.exists(placed):
        log("solving the co-activation order")
        out = cli("solve", "-m", path, "--stats", stats_path, "--vram", "0", "--order", "coactive", "-o", placed)
        print(next((ln for ln in out.splitlines() if ln.startswith("co-activation order")), ""))
    pred, layout = cluster_predictor(path, base + ".cluster-predictor.gguf", a.cluster)

    # Rows a step reads, from the held-out half of the profile's samples.
    st = stats_mod.load(stats_path)
    order = harness.internal("placement").read_placement(placed)["neuron_order"]
    F = st.freq.shape[1]
    runs = {"file": [], "co": {g: [] for g in [1] + a.groups}}
    for l, (of, d) in enumerate(layout):
        x = st.sample_x[l, 1::2].astype(np.float32)
        masks = (x @ d.T > 0)[:, of]
        runs["file"].append(mean_run(masks, np.arange(F), 1))
        for g in runs["co"]:
            runs["co"][g].append(mean_run(masks, order[l], g))

    text = open(harness.TEXT, encoding="utf-8").read()
    n_ctx = a.n_prompt + a.n_gen + 8
    peer = harness.load_peer(path, n_ctx, a.threads)
    ids = optiml.Model(path, n_ctx=16, sparsity="none", predictors=None).tokenize(text[len(text) // 2:],
                                                                                    add_bos=False)
    configs = [("dense", path, None, 1, None), ("file order", path, pred, 1, np.mean(runs["file"]))]
    configs += [(f"co-active" + (f", g={g}" if g > 1 else ""), placed, pred, g, np.mean(runs["co"][g]))
                for g in [1] + a.groups]
    rows = []
    for name, p_, pr, g, run in configs:
        log(f"{name}")
        o, p, share, copy = run_optiml(a, p_, pr, g, peer, ids, n_ctx)
        log(f"{name}: optiml {[round(v, 2) for v in o]}, llama.cpp {[round(v, 2) for v in p]}, computed {share}")
        rows.append((name, o, p, share, run, copy))
    close(peer)
    # The order's own effect, side by side: the two orders with the same predictor, alternated.
    log("co-active against file order, alternated")
    fm = optiml.Model(path, n_ctx=n_ctx, n_threads=a.threads, sparsity="none", predictors=pred)
    cm = optiml.Model(placed, n_ctx=n_ctx, n_threads=a.threads, sparsity="none", predictors=pred)
    co_runs, file_runs = alternate_tg_text(cm, fm, ids, a.n_prompt, a.n_gen, a.repeats)
    close(cm)
    close(fm)
    results.add(ffn="co-active over file order (alternated)", optiml_runs=co_runs, file_order_runs=file_runs,
                ratio=statistics.median(co_runs) / statistics.median(file_runs))

    od = statistics.median(rows[0][1]) / statistics.median(rows[0][2])
    print(f"### {'tiny (smoke test)' if a.tiny else '7B-shaped'} SwiGLU, planted clusters of {a.cluster}, random Q4_0 weights, {a.threads} threads")
    print(f"{harness.machine_line()}; tg: {a.n_gen} text tokens after {a.n_prompt}, median (range) of {a.repeats}, "
          "each OptiML row alternated with llama.cpp dense on the same file\n")
    print("| FFN | gate/up rows computed | mean run of rows read | optiml tok/s | llama.cpp dense tok/s | ratio | "
          "vs optiml dense | placed copy (GiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, o, p, share, run, copy in rows:
        r = statistics.median(o) / statistics.median(p)
        results.add(ffn=name, computed=share, mean_run=run, optiml=statistics.median(o), optiml_runs=o,
                    llama_cpp=statistics.median(p), llama_cpp_runs=p, ratio=r, vs_dense=r / od,
                    placed_copy_bytes=copy["bytes"])
        print(f"| {name} | {'-' if share is None else f'{share:.3f}'} | {'-' if run is None else f'{run:.1f}'} | "
              f"{spread(o, '.2f')} | {spread(p, '.2f')} | {r:.2f}x{' (noisy)' if noisy(o, p) else ''} | "
              f"{r / od:.2f}x | {copy['bytes'] / 2**30:.2f} |")
    best = max(rows[2:], key=lambda row: statistics.median(row[1]) / statistics.median(row[2]))
    per_run = [o / p for o, p in zip(best[1], best[2])]
    hits = sum(x >= GOAL for x in per_run)
    print(f"\ngoal: co-active >= {GOAL}x llama.cpp dense in 4 of 5 runs -> {best[0]}: per-run ratios "
          f"{', '.join(f'{x:.2f}' for x in per_run)} ({hits} of {len(per_run)} at or above)")
    print(f"co-active over file order, the two alternated with each other: "
          f"{statistics.median(co_runs) / statistics.median(file_runs):.2f}x ({spread(co_runs, '.2f')} against "
          f"{spread(file_runs, '.2f')} tok/s)")
    print("vs optiml dense: each row's ratio to llama.cpp divided by the dense row's (llama.cpp the common "
          "reference across the pairs)")
    results.note(f"cluster {a.cluster}, samples {a.samples}")
    results.write(a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
