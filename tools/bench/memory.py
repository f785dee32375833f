#!/usr/bin/env python3
"""Peak resident memory of a model run dense and sparse, against its file size and KV cache.

Each mode runs in a fresh process (so one mode's pages do not count in the other's): load, a prompt of
--prompt tokens, --tokens generated; the child reports its own peak RSS (VmHWM, not inherited from this
process). The budget of issue 13: dense at most file + KV + 10% of the file, sparse at most file + KV + 25%.
Sparse runs twice, with each neuron-major down copy (Model(down_copy=...)): "fast" (8-bit rows) and "compact" (the file's
Q4_0/Q4_1/Q4_K codes regrouped, lossless); the default "auto" picks fast unless memory is short.

    python tools/make_synthetic_model.py -o /tmp/llama7b-q4_0.gguf            # 3.6 GiB, ~2 minutes
    python tools/bench/memory.py -m /tmp/llama7b-q4_0.gguf --threshold 0.05   # SwiGLU: a custom threshold
    python tools/bench/memory.py -m smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import harness


def child(a) -> None:
    import optiml

    kw = {"sparsity": "none"} if a.mode == "dense" else {"sparsity": "threshold", "thresholds": a.threshold,
                                                         "down_copy": a.mode.split("-")[1]}
    m = optiml.Model(a.model, n_ctx=a.ctx, n_threads=a.threads, **kw)
    ids = list(range(1000, 1000 + a.prompt))
    m.eval(ids)
    for i in range(a.tokens):
        m.eval([2000 + i])
    stats = m.sparsity_stats() if a.mode != "dense" else {"skipped": 0.0}
    print(json.dumps({"peak_rss": harness.peak_rss(),
                      "kv_bytes": m._session.kv_bytes, "skipped": stats["skipped"]}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="a GGUF file or a known model name")
    ap.add_argument("-t", "--threads", type=harness.positive, default=2)
    ap.add_argument("--ctx", type=harness.positive, default=512)
    ap.add_argument("--prompt", type=harness.positive, default=32)
    ap.add_argument("--tokens", type=harness.at_least(0), default=8)
    ap.add_argument("--threshold", type=float, default=0.0, help="sparse mode's threshold for every layer "
                    "(0: exact zero-skipping, for ReLU models)")
    ap.add_argument("--mode", choices=("dense", "sparse-fast", "sparse-compact"), help=argparse.SUPPRESS)
    a, res = harness.parse(ap, "memory", argv)
    if a.mode:
        child(a)
        return 0

    a.model = harness.model_arg(ap, a.model)
    if a.prompt + a.tokens > a.ctx:
        ap.error(f"--prompt {a.prompt} and --tokens {a.tokens} do not fit in --ctx {a.ctx}")
    size = os.path.getsize(a.model)
    print(f"{os.path.basename(a.model)}: file {size / 2**30:.2f} GiB; ctx {a.ctx}, prompt {a.prompt}, "
          f"{a.tokens} tokens, {a.threads} threads")
    print("| mode | peak RSS | file + KV | over file + KV | budget (share of file) | within |")
    print("|---|---|---|---|---|---|")
    for mode, share in (("dense", 0.10), ("sparse-fast", 0.25), ("sparse-compact", 0.25)):
        cmd = [sys.executable, __file__, "-m", a.model, "--mode", mode, "-t", str(a.threads), "--ctx", str(a.ctx),
               "--prompt", str(a.prompt), "--tokens", str(a.tokens), "--threshold", str(a.threshold)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"the {mode} run failed ({run.returncode}): {' '.join(cmd)}\n{run.stderr[-3000:]}")
        r = json.loads(run.stdout.strip().splitlines()[-1])
        base = size + r["kv_bytes"]
        over = r["peak_rss"] - base
        res.add(mode=mode, skipped=r.get("skipped"), peak_rss_gib=r["peak_rss"] / 2**30, file_kv_gib=base / 2**30,
                over_mib=over / 2**20, over_share_of_file=over / size, budget_share=share, within=over <= share * size)
        print(f"| {mode}{' (%.0f%% skipped)' % (100 * r['skipped']) if mode != 'dense' else ''} | "
              f"{r['peak_rss'] / 2**30:.2f} GiB | {base / 2**30:.2f} GiB | {over / 2**20:+.0f} MiB "
              f"({100 * over / size:+.1f}% of file) | {100 * share:.0f}% | {'yes' if over <= share * size else 'NO'} |",
              flush=True)
    res.write(a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
