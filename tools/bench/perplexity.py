#!/usr/bin/env python3
"""Whole-text perplexity of OptiML and llama.cpp (llama-cpp-python) on the same token windows, and
optionally both engines' KL divergence against transformers float32 on the file's dequantized weights:
the long measurements that used to run in the test suite (the tests now use 512 tokens).

    PYTHONPATH=python python tools/bench/perplexity.py smollm2-135m-instruct-q4_1 gemma3-270m-q4_k_m
    PYTHONPATH=python python tools/bench/perplexity.py MODEL.gguf --ctx 256 --kld

Figures to expect (shared/eval/REFERENCE.md; 2-core AVX2 Zen 3, ctx 256, the whole of
scandal-in-bohemia.txt): llama.cpp perplexity SmolLM2 Q4_1 24.72, Gemma3 Q4_K_M 23.81; KLD against
transformers f32 0.0031 (same top 95.7%) and 0.0048 (95.5%). OptiML should be within 1% on perplexity
and within 10% on KLD. Exits 1 when it is not (--check).
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


def run(path: str, text: str, n_ctx: int, n_chunks: int, kld: bool) -> dict:
    fidelity = harness.fidelity()

    with optiml.Model(path, n_ctx=n_ctx, n_threads=2) as m:
        ws = px.windows(m, text, n_ctx, n_chunks)
        llm = fidelity.load_llama_cpp(path, n_ctx)
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
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=-1, help="windows (default: all)")
    ap.add_argument("--kld", action="store_true", help="also KL divergence against transformers f32 (every "
                    "position of every window; needs torch and transformers, and memory for n_ctx x n_vocab)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless OptiML's perplexity is within 1%% of "
                    "llama.cpp's and its KLD within 10%%")
    a, res = harness.parse(ap, "perplexity", argv)
    with open(a.file, encoding="utf-8") as f:
        text = f.read()

    ok = True
    print("| model | tokens | engine | PPL | KLD vs f32 | same top | seconds |")
    print("|---|---|---|---|---|---|---|")
    for name in a.models:
        r = run(harness.model_path(name, pull=True), text, a.ctx, a.chunks, a.kld)
        for eng in ("ours", "llama.cpp"):
            e = r[eng]
            res.add(model=os.path.basename(name), tokens=r["tokens"], engine=eng, ppl=e["ppl"], ppl_err=e["err"],
                    kld=e.get("kld"), same_top=e.get("same_top"), seconds=e["s"])
            kl = f"{e['kld']:.5f}" if "kld" in e else "—"
            st = f"{100 * e['same_top']:.2f}%" if "same_top" in e else "—"
            print(f"| {os.path.basename(name)} | {r['tokens']} | {eng} | {e['ppl']:.4f} ± {e['err']:.4f} | {kl} | {st} "
                  f"| {e['s']:.1f} |")
        ok &= abs(r["ours"]["ppl"] / r["llama.cpp"]["ppl"] - 1) < 0.01
        if a.kld:
            ok &= r["ours"]["kld"] <= 1.1 * r["llama.cpp"]["kld"]
    res.write(a.json)
    return 0 if ok or not a.check else 1


if __name__ == "__main__":
    sys.exit(main())
