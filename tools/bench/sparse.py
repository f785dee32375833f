#!/usr/bin/env python3
"""What FFN sparsity buys: OptiML at several calibrated sparsity targets beside llama.cpp dense
(llama-cpp-python, the CPU peer), same files, same thread count, in one run (issue 6, item 3).

Two benchmarks (--only picks one; both 7B ones by default run after SmolLM2):

smollm2   SmolLM2-135M-Instruct Q4_1. For each target in --targets (default 0 0.3 0.5 0.7 0.9) the model is
          calibrated (optiml.calibrate) on the first --calib-frac of the shared eval text
          (tests/data/scandal-in-bohemia.txt), then perplexity is measured on the rest of the text
          (llama.cpp's convention, --ctx 256; target 0 is plain dense OptiML) and generation speed is timed
          alternating with llama.cpp dense on the original file.
7b-relu   A 7B-shaped llama model with random Q4_0 weights (tools/make_synthetic_model.py; written to
7b-silu   --model-dir when missing, ~2 minutes and 3.6 GiB each), ReLU and SwiGLU variants. Calibrated at
          --targets-7b (default 0.5 0.8 0.9) on a few hundred tokens of the eval text, then generation
          speed for OptiML dense, each sparsity, and llama.cpp dense on the same file.

Generation speed ("tg") is timed llama-bench style but on real text: the model reads a short prompt of
eval-text tokens, then --n-gen further eval-text tokens are fed one at a time (teacher forcing, so both
engines do exactly the same work and see realistic activations); tokens/s of those single-token steps,
median of --repeats runs, OptiML and llama.cpp runs alternating so that drift on a shared machine hits
both alike. Ratios are against the llama.cpp runs interleaved with that row.

The calibrated files run with Model(sparsity="threshold") (--mode): the sparse path is what is measured,
whatever the engine's speed probe would choose. A row whose measured sparsity is under 1% ran dense (with
--mode auto the probe may choose the dense FFN: its note is printed): it is marked so and never counts
toward a goal.

Note: llama.cpp does not read optiml.ffn.activation, so it runs SiLU on the ReLU file: the same work per
token, which is what a speed comparison needs (its outputs differ).

    PYTHONPATH=python python tools/bench/sparse.py                      # everything (~30+ minutes on 2 cores)
    PYTHONPATH=python python tools/bench/sparse.py --only smollm2 --quick
    PYTHONPATH=python python tools/bench/sparse.py --only 7b-relu --model-dir /work/synth-models

Needs the sparsity API (optiml.calibrate, Model(sparsity=...), Model.sparsity_stats()); without it only
the dense rows are measured and the script says so.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

import harness
import optiml
from harness import alternate_tg_text as alternate, close, log, noisy, spread

models = harness.internal("models")
perplexity = harness.internal("perplexity").perplexity
EVAL_TEXT = harness.TEXT
SMOLLM2 = harness.model_path("smollm2-135m-instruct-q4_1")
SMOLLM2_REF_PPL = 24.72  # llama.cpp, full text, ctx 256 (../shared/eval/REFERENCE.md, beside the checkout)
GOALS = {"smollm2": 1.3, "7b-relu": (0.9, 2.2), "7b-silu": (0.5, 1.3)}
# A row that skipped less than this share of the FFN neurons ran dense (sparsity="auto" chose the dense
# FFN, or the thresholds skip nothing): it is shown as such and never counts toward a goal.
RAN_DENSE = 0.01
RESULTS = harness.Results("sparse")  # every table's rows, for --json


# ---- the sparsity API (being built: these few functions are where it plugs in) ----------------------
def sparse_api_missing() -> str | None:
    """Why sparse rows cannot run, or None when optiml has the sparsity API."""
    missing = []
    if not hasattr(optiml, "calibrate"):
        missing.append("optiml.calibrate")
    if "sparsity" not in inspect.signature(optiml.Model.__init__).parameters:
        missing.append("optiml.Model(sparsity=...)")
    if not hasattr(optiml.Model, "sparsity_stats"):
        missing.append("Model.sparsity_stats()")
    if missing:
        return (f"the sparsity API is not in this optiml ({optiml.__file__}): missing {', '.join(missing)}; "
                "only dense rows are measured")
    return None


def load_optiml(path: str, n_ctx: int, threads: int, sparsity: str | None):
    """sparsity None: dense (sparsity="none" where the API exists); else "threshold" (the sparse path,
    whatever its speed) or "auto" (the engine's speed probe may choose the dense FFN: its note is logged)."""
    kw = {}
    if sparsity is not None:
        kw["sparsity"] = sparsity
    elif sparse_api_missing() is None:
        kw["sparsity"] = "none"
    m = optiml.Model(path, n_ctx=n_ctx, n_threads=threads, **kw)
    note = getattr(m, "sparsity_note", "")
    if sparsity is not None and note:
        log(f"{os.path.basename(path)}: {note}")
    return m


def ran_dense(sparsity: float | None) -> bool:
    """Whether a row's measured sparsity says it ran dense (None: not measured, so not known to be sparse)."""
    return sparsity is None or sparsity < RAN_DENSE


def fallback_note(model) -> str | None:
    """Why a sparse row ran dense, when sparsity="auto" chose the dense FFN (Model.sparsity_note)."""
    note = getattr(model, "sparsity_note", "")
    return note if note and getattr(model, "sparsity", None) == "none" else None


def calibrated(src: str, target: float, calib_text: str, n_tokens: int, out_dir: str, redo: bool,
               criterion: str) -> str:
    """A copy of src with per-layer thresholds for `target` (reused when present and newer than src)."""
    stem = os.path.splitext(os.path.basename(src))[0]
    out = os.path.join(out_dir, f"{stem}.sparse{round(target * 100):02d}-{criterion}.gguf")
    if not redo and os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(src):
        log(f"reusing {out}")
        return out
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    optiml.calibrate(src, texts=[calib_text], target=target, out=out, n_tokens=n_tokens, criterion=criterion,
                     progress=False)
    log(f"calibrated {os.path.basename(src)} at {target:.2f} in {time.perf_counter() - t0:.1f} s -> {out}")
    return out


def overall_sparsity(model) -> float | None:
    """The measured share of skipped FFN neurons over all layers, from Model.sparsity_stats()."""
    if not hasattr(model, "sparsity_stats"):
        return None
    s = model.sparsity_stats()
    if isinstance(s, (int, float)):
        return float(s)
    if isinstance(s, dict):
        for k in ("overall", "total", "mean", "skipped"):
            if isinstance(s.get(k), (int, float)):
                return float(s[k])
        per = s.get("per_layer") or s.get("layers")
    else:
        per = s
    try:
        return float(statistics.fmean(float(x) for x in per))
    except (TypeError, ValueError, statistics.StatisticsError):
        return None


def peer_perplexity(path: str, tokens: list[int], n_ctx: int, threads: int, n_chunks: int) -> float:
    """llama.cpp's perplexity of the same token ids, by optiml.cli.perplexity's convention (no-BOS
    models only, as SmolLM2): non-overlapping windows, each from an empty context, second half scored."""
    import numpy as np

    peer = harness.load_peer(path, n_ctx, threads, all_logits=True)
    n = len(tokens) // n_ctx if n_chunks < 0 else min(n_chunks, len(tokens) // n_ctx)
    first, nll, count = n_ctx // 2, 0.0, 0
    for i in range(n):
        window = tokens[i * n_ctx : (i + 1) * n_ctx]
        peer.reset()
        peer.eval(window)
        rows = np.asarray(peer.scores[first : n_ctx - 1], dtype=np.float64)
        targets = np.asarray(window[first + 1 : n_ctx])
        mx = rows.max(axis=1, keepdims=True)
        logz = np.log(np.exp(rows - mx).sum(axis=1)) + mx[:, 0]
        nll += float((logz - rows[np.arange(len(targets)), targets]).sum())
        count += len(targets)
    close(peer)
    return float(np.exp(nll / count))


def fmt(x, spec, none="—"):
    return none if x is None else format(x, spec)


# ---- SmolLM2 ------------------------------------------------------------------------------------
def bench_smollm2(a, api_missing: str | None) -> list[str]:
    text = open(EVAL_TEXT, encoding="utf-8").read()
    cut = text.find("\n\n", int(len(text) * a.calib_frac))
    calib, held = text[:cut], text[cut:].lstrip("\n")
    tok = optiml.Model(SMOLLM2, n_ctx=64, n_threads=a.threads)
    ids = tok.tokenize(held, add_bos=False)
    ptoks = tok.tokenize(held, add_bos=True)  # what optiml.cli.perplexity scores
    n_calib = len(tok.tokenize(calib, add_bos=False))
    close(tok)
    n_prompt, n_gen = a.n_prompt, a.n_gen
    n_ctx = max(a.ctx, n_prompt + n_gen + 8)
    chunks = 8 if a.quick else -1
    peer = harness.load_peer(SMOLLM2, n_ctx, a.threads)

    rows = []
    targets = a.targets if api_missing is None else [0.0]
    runs = [(0.0, "dense")] + [(t, c) for c in a.criterion for t in targets if t > 0]
    for target, crit in runs:
        if target == 0:
            path, mode = SMOLLM2, None
        else:
            path, mode = calibrated(SMOLLM2, target, calib, n_calib, a.model_dir, a.recalibrate, crit), a.mode
        m = load_optiml(path, n_ctx, a.threads, mode)
        t0 = time.perf_counter()
        ppl, err, n_scored = perplexity(m, held, a.ctx, chunks)
        log(f"SmolLM2 {crit} {target}: PPL {ppl:.3f} ± {err:.3f} ({n_scored} tokens, "
            f"{time.perf_counter() - t0:.0f} s)")
        ours, theirs = alternate(m, peer, ids, n_prompt, n_gen, a.repeats)
        sp = overall_sparsity(m) if mode else 0.0
        rows.append((crit, target, sp, ppl, err, ours, theirs, fallback_note(m) if mode else None))
        log(f"  tg optiml {[round(x, 1) for x in ours]}, llama.cpp {[round(x, 1) for x in theirs]}")
        close(m)
    close(peer)

    peer_ppl = None
    if a.peer_ppl:
        t0 = time.perf_counter()
        peer_ppl = peer_perplexity(SMOLLM2, ptoks, a.ctx, a.threads, chunks)
        log(f"SmolLM2 llama.cpp dense PPL {peer_ppl:.3f} ({time.perf_counter() - t0:.0f} s)")

    dense_ppl = rows[0][3]
    out = [f"### SmolLM2-135M-Instruct Q4_1, {a.threads} threads",
           f"calibration: first {a.calib_frac:.0%} of the eval text ({n_calib} tokens); PPL: the remaining "
           f"{len(ids)} tokens, ctx {a.ctx}{', first 8 windows' if a.quick else ''} (llama.cpp dense: "
           f"{fmt(peer_ppl, '.3f', 'not measured (--peer-ppl)')} on the same tokens, {SMOLLM2_REF_PPL} on the "
           f"full text per ../shared/eval/REFERENCE.md); tg: {n_gen} text tokens after {n_prompt}, median of {a.repeats}",
           "",
           "| criterion | target | measured sparsity | PPL | PPL vs dense | tg tok/s | llama.cpp dense tok/s | ratio |",
           "|---|---|---|---|---|---|---|---|"]
    best, notes = None, []
    for crit, target, sp, ppl, err, o, p, note in rows:
        d = (ppl / dense_ppl - 1) * 100
        tg, ref = statistics.median(o), statistics.median(p)
        dense = target > 0 and ran_dense(sp)  # a sparse row that ran dense: shown, never counted
        RESULTS.add(model="smollm2-q4_1", criterion=crit, target=target, sparsity=sp, ran_dense=dense, ppl=ppl,
                    ppl_err=err, ppl_vs_dense_pct=d, tg=tg, tg_runs=o, peer_tg=ref, peer_runs=p, ratio=tg / ref,
                    noisy=noisy(o, p))
        out.append(f"| {crit} | {target:.1f} | {fmt(sp, '.3f')}{' (ran dense)' if dense else ''} | {ppl:.3f} ± "
                   f"{err:.2f} | {d:+.2f}% | {spread(o, '.1f')} | {spread(p, '.1f')} | "
                   f"{tg / ref:.2f}x{' (noisy)' if noisy(o, p) else ''} |")
        if note:
            notes.append(f"{crit} {target:.1f} ran dense: {note}")
        if target > 0 and not dense and d <= 3.0 and (best is None or tg / ref > best[1]):
            best = (f"{crit} {target:.1f}", tg / ref, noisy(o, p))
    out.append("")
    out += [f"note: {n}" for n in notes]
    for n in notes:
        RESULTS.note(n)
    goal = f"goal: within 3% of dense PPL, tg >= {GOALS['smollm2']}x llama.cpp dense -> "
    if best is None:
        out.append(goal + "not measured: no sparse row both skipped neurons and stayed within 3% of dense PPL")
    else:
        out.append(goal + f"best: {best[0]} at {best[1]:.2f}x ({'met' if best[1] >= GOALS['smollm2'] else 'NOT met'}"
                   f"{'; timings noisy, rerun on a quiet machine' if best[2] else ''})")
    return out


# ---- 7B-shaped synthetic models -----------------------------------------------------------------
def bench_7b(a, act: str, api_missing: str | None) -> list[str]:
    path = harness.synthetic_7b(a.model_dir, act)
    text = open(EVAL_TEXT, encoding="utf-8").read()
    n_prompt, n_gen = a.n_prompt_7b, a.n_gen_7b
    n_ctx = n_prompt + n_gen + 8
    peer = harness.load_peer(path, n_ctx, a.threads)
    ours = load_optiml(path, n_ctx, a.threads, None)
    ids = ours.tokenize(text[len(text) // 2 :], add_bos=False)  # timing text: not the calibration text
    calib_text = text[: 4 * a.calib_tokens_7b]  # ~4 characters a token; calibrate() takes n_tokens of it

    rows, notes = [], []
    o, p = alternate(ours, peer, ids, n_prompt, n_gen, a.repeats_7b)
    log(f"7B {act} dense: optiml {[round(x, 2) for x in o]}, llama.cpp {[round(x, 2) for x in p]}")
    rows.append((0.0, 0.0, o, p))
    close(ours)
    for target in (a.targets_7b if api_missing is None else []):
        cpath = calibrated(path, target, calib_text, a.calib_tokens_7b, a.model_dir, a.recalibrate, a.criterion_7b)
        m = load_optiml(cpath, n_ctx, a.threads, a.mode)
        o, p = alternate(m, peer, ids, n_prompt, n_gen, a.repeats_7b)
        sp = overall_sparsity(m)
        log(f"7B {act} target {target}: sparsity {sp}, optiml {[round(x, 2) for x in o]}, "
            f"llama.cpp {[round(x, 2) for x in p]}")
        rows.append((target, sp, o, p))
        if fallback_note(m):
            notes.append(f"{target:.0%} ran dense: {fallback_note(m)}")
        close(m)
        if cpath != path and not a.keep_calibrated:
            os.unlink(cpath)
    close(peer)

    label = {"relu": "ReLU (OptiML: relu(gate)*up; llama.cpp runs SiLU on it)", "silu": "SwiGLU"}[act]
    out = [f"### 7B-shaped llama, random Q4_0 weights, {label}, {a.threads} threads",
           f"{os.path.basename(path)} ({os.path.getsize(path) / 2**30:.2f} GiB); tg: {n_gen} text tokens after "
           f"{n_prompt}, median of {a.repeats_7b}",
           "",
           "| FFN sparsity target | measured | optiml tg tok/s | llama.cpp dense tok/s | ratio |",
           "|---|---|---|---|---|"]
    for target, sp, o, p in rows:
        dense = target > 0 and ran_dense(sp)  # a sparse row that ran dense: shown, never counted
        RESULTS.add(model=os.path.basename(path), criterion=a.criterion_7b, target=target, sparsity=sp,
                    ran_dense=dense, tg=statistics.median(o), tg_runs=o, peer_tg=statistics.median(p), peer_runs=p,
                    ratio=statistics.median(o) / statistics.median(p), noisy=noisy(o, p))
        out.append(f"| {target:.0%} | {fmt(sp, '.3f')}{' (ran dense)' if dense else ''} | {spread(o, '.2f')} | "
                   f"{spread(p, '.2f')} | {statistics.median(o) / statistics.median(p):.2f}x"
                   f"{' (noisy)' if noisy(o, p) else ''} |")
    gt, gr = GOALS[f"7b-{act}"]
    hit = [r for r in rows if abs(r[0] - gt) < 1e-9 and not ran_dense(r[1])]
    out.append("")
    out += [f"note: {n}" for n in notes]
    for n in notes:
        RESULTS.note(n)
    if hit:
        r = statistics.median(hit[0][2]) / statistics.median(hit[0][3])
        out.append(f"goal: {gt:.0%} sparsity >= {gr}x llama.cpp dense -> {r:.2f}x ({'met' if r >= gr else 'NOT met'}"
                   f"{'; timings noisy, rerun on a quiet machine' if noisy(hit[0][2], hit[0][3]) else ''})")
    else:
        out.append(f"goal: {gt:.0%} sparsity >= {gr}x llama.cpp dense -> not measured (no row at {gt:.0%} that "
                   "skipped neurons)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=harness.positive, default=2)
    ap.add_argument("--only", choices=("smollm2", "7b-relu", "7b-silu"), action="append",
                    help="run only this benchmark (repeatable); default: all three")
    ap.add_argument("--quick", action="store_true", help="fewer PPL windows, repeats and tokens; 7B: only the "
                    "goal's sparsity")
    ap.add_argument("--repeats", type=harness.positive, default=None, help="SmolLM2 tg runs per row (default 5; quick 3)")
    ap.add_argument("--repeats-7b", type=harness.positive, default=None, help="7B tg runs per row (default 5; quick 2)")
    ap.add_argument("--targets", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--targets-7b", type=float, nargs="+", default=None, help="default 0.5 0.8 0.9")
    ap.add_argument("--mode", choices=("threshold", "auto"), default="threshold",
                    help="Model(sparsity=...) for the calibrated files (default threshold: the sparse path is "
                         "what is measured; auto lets the engine's speed probe choose the dense FFN where that is "
                         "faster here, and such rows are marked as run dense and never count toward a goal)")
    ap.add_argument("--ctx", type=int, default=256, help="perplexity window")
    ap.add_argument("--calib-frac", type=float, default=0.2, help="SmolLM2: share of the eval text used to "
                    "calibrate; perplexity is measured on the rest")
    ap.add_argument("--peer-ppl", action="store_true", help="SmolLM2: also llama.cpp's perplexity on the "
                    "same tokens (~1 minute)")
    ap.add_argument("--calib-tokens-7b", type=int, default=384)
    ap.add_argument("--criterion", choices=("product", "weighted", "gate"), nargs="+", default=["product", "weighted"],
                    help="SmolLM2 calibration criteria, each at every target (default: product weighted)")
    ap.add_argument("--criterion-7b", choices=("product", "weighted", "gate"), default="gate",
                    help="7B calibration criterion (default gate: skips up rows too; random weights have no "
                         "quality to keep)")
    ap.add_argument("--n-prompt", type=harness.positive, default=32)
    ap.add_argument("--n-gen", type=harness.positive, default=None, help="SmolLM2 tg tokens (default 128; quick 64)")
    ap.add_argument("--n-prompt-7b", type=harness.positive, default=8)
    ap.add_argument("--n-gen-7b", type=harness.positive, default=None, help="7B tg tokens (default 32; quick 16)")
    ap.add_argument("--model-dir", default=str(models.cache_dir() / "synthetic"),
                    help="where the 7B files and calibrated copies go (default: the model cache's synthetic/)")
    ap.add_argument("--recalibrate", action="store_true", help="calibrate again even where a copy exists")
    ap.add_argument("--keep-calibrated", action="store_true", help="keep the 7B calibrated copies (3.6 GiB each)")
    harness.add_json_arg(ap)
    a = ap.parse_args(argv)
    if not all(0 <= t < 1 for t in a.targets + (a.targets_7b or [])):
        ap.error("--targets and --targets-7b are shares of the neurons to skip: each in [0, 1)")
    a.repeats = a.repeats or (3 if a.quick else 5)
    a.repeats_7b = a.repeats_7b or (2 if a.quick else 5)
    a.n_gen = a.n_gen or (64 if a.quick else 128)
    a.n_gen_7b = a.n_gen_7b or (16 if a.quick else 32)
    only = a.only or ["smollm2", "7b-relu", "7b-silu"]
    harness.llama_cpp()  # exits with how to install it when missing

    load = os.getloadavg()[0]
    if load > 0.5:
        log(f"warning: load average {load:.1f} before starting; other work on this machine makes timings noisy "
            "(the tables show each row's median and range)")
    api_missing = sparse_api_missing()
    if api_missing:
        log(api_missing)
    report = [harness.machine_line() + f", optiml {optiml.__version__}, {a.threads} threads"
              + (f"; {api_missing}" if api_missing else ""), ""]
    for name in only:
        if name == "smollm2":
            report += bench_smollm2(a, api_missing)
        else:
            act = name.split("-")[1]
            if a.targets_7b is None:
                a_targets = [GOALS[name][0]] if a.quick else [0.5, 0.8, 0.9]
            else:
                a_targets = a.targets_7b
            a7 = argparse.Namespace(**{**vars(a), "targets_7b": a_targets})
            report += bench_7b(a7, act, api_missing)
        report.append("")
        print("\n".join(report), flush=True)  # partial results survive a later failure
        report = []
    RESULTS.write(a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
