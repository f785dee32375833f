#!/usr/bin/env python3
"""Whole-text perplexity of OptiML and llama.cpp (llama-cpp-python) on the same token windows, and
optionally both engines' KL divergence against transformers float32 on the file's dequantized weights:
the long measurements that used to run in the test suite (the tests now use 512 tokens).

    PYTHONPATH=python python tools/bench/perplexity.py smollm2-135m-instruct-q4_1 gemma3-270m-q4_k_m
    PYTHONPATH=python python tools/bench/perplexity.py MODEL.gguf --ctx 256 --kld

It compares the two engines, so it needs llama-cpp-python (pip install ".[bench]"); OptiML's perplexity
alone is `optiml perplexity -m MODEL -f TEXT --ctx 256`.

Figures to expect (../shared/eval/REFERENCE.md, beside the checkout rather than in it; 2-core AVX2 Zen 3,
ctx 256, the whole of scandal-in-bohemia.txt): llama.cpp perplexity SmolLM2 Q4_1 24.72, Gemma3 Q4_K_M
23.81; KLD against transformers f32 0.0031 (same top 95.7%) and 0.0048 (95.5%). OptiML should be within 1%
on perplexity and within 10% on KLD: --check exits 1, saying which comparison failed, when it is not.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

import harness
import optiml

px = harness.internal("perplexity")

TEXT = str(harness.TEXT)


PPL_BOUND = 0.01  # OptiML's perplexity within 1% of llama.cpp's
KLD_BOUND = 1.10  # and its KLD against f32 at most 10% above llama.cpp's


def run(path: str, text: str, n_ctx: int, n_chunks: int, kld: bool, threads: int) -> dict:
    fidelity = harness.fidelity()

    with optiml.Model(path, n_ctx=n_ctx, n_threads=threads) as m:
        ws = px.windows(m, text, n_ctx, n_chunks)
        llm = harness.load_peer(path, n_ctx, threads, all_logits=True)
        out = {"tokens": len(ws) * (n_ctx // 2 - 1)}
        t0 = time.perf_counter()
        ppl, err, _ = px.perplexity(m, text, n_ctx, n_chunks)
        out["ours"] = {"ppl": ppl, "err": err, "s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        nll = []
        for w in ws:
            logp = px.log_softmax(fidelity.llama_cpp_logits(llm, w)[n_ctx // 2 : n_ctx - 1])
            nll.append(-logp[np.arange(len(logp)), w[n_ctx // 2 + 1 :]])
        nll = np.concatenate(nll)
        p = math.exp(nll.mean())
        out["llama.cpp"] = {"ppl": p, "err": p * nll.std() / math.sqrt(len(nll) - 1), "s": time.perf_counter() - t0}
        if kld:
            for name, r in fidelity.kld_against_transformers(path, m, llm, ws).items():
                out[name].update(kld=r["kld"], same_top=r["same_top"])
        llm.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="GGUF files or known model names")
    ap.add_argument("-f", "--file", default=TEXT, help="text (default: tests/data/scandal-in-bohemia.txt)")
    ap.add_argument("-t", "--threads", type=harness.positive, default=2, help="threads, both engines (default 2)")
    ap.add_argument("--ctx", type=harness.at_least(8), default=256)
    ap.add_argument("--chunks", type=int, default=-1, help="windows (default: all)")
    ap.add_argument("--kld", action="store_true", help="also KL divergence against transformers f32 (every "
                    "position of every window; needs torch and transformers, and memory for n_ctx x n_vocab)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless OptiML's perplexity is within 1%% of "
                    "llama.cpp's and (with --kld) its KLD within 10%%, saying which comparison failed")
    a, res = harness.parse(ap, "perplexity", argv)
    if a.chunks == 0 or a.chunks < -1:
        ap.error(f"--chunks must be at least 1 (or -1: all), not {a.chunks}")
    try:
        with open(a.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        ap.error(f"--file {a.file}: {e.strerror}")
    paths = [harness.model_arg(ap, name) for name in a.models]
    harness.llama_cpp(instead="optiml perplexity -m MODEL -f TEXT: OptiML alone")

    failed = []
    print("| model | tokens | engine | PPL | ratio to llama.cpp | KLD vs f32 | same top | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, path in zip(a.models, paths):
        r = run(path, text, a.ctx, a.chunks, a.kld, a.threads)
        peer_ppl = r["llama.cpp"]["ppl"]
        for eng in ("ours", "llama.cpp"):
            e = r[eng]
            res.add(model=os.path.basename(path), tokens=r["tokens"], engine=eng, ppl=e["ppl"], ppl_err=e["err"],
                    ratio=e["ppl"] / peer_ppl, kld=e.get("kld"), same_top=e.get("same_top"), seconds=e["s"])
            kl = f"{e['kld']:.5f}" if "kld" in e else "—"
            st = f"{100 * e['same_top']:.2f}%" if "same_top" in e else "—"
            print(f"| {os.path.basename(path)} | {r['tokens']} | {eng} | {e['ppl']:.4f} ± {e['err']:.4f} | "
                  f"{e['ppl'] / peer_ppl:.4f} | {kl} | {st} | {e['s']:.1f} |")
        ours = r["ours"]["ppl"]
        if abs(ours / peer_ppl - 1) >= PPL_BOUND:
            failed.append(f"{os.path.basename(path)}: perplexity {ours:.4f} against llama.cpp's {peer_ppl:.4f} is "
                          f"{100 * abs(ours / peer_ppl - 1):.2f}% apart (bound {100 * PPL_BOUND:.0f}%)")
        if a.kld and r["ours"]["kld"] > KLD_BOUND * r["llama.cpp"]["kld"]:
            failed.append(f"{os.path.basename(path)}: KLD {r['ours']['kld']:.5f} against llama.cpp's "
                          f"{r['llama.cpp']['kld']:.5f} is more than {KLD_BOUND:.2f}x it")
    res.write(a.json)
    if a.check:
        what = f"perplexity within {100 * PPL_BOUND:.0f}% of llama.cpp's" + (
            f", KLD at most {KLD_BOUND:.2f}x llama.cpp's" if a.kld else "")
        for line in failed:
            print(f"check failed: {line}", file=sys.stderr)
        print(f"check ({what}): {'FAILED' if failed else 'passed'}", file=sys.stderr)
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
