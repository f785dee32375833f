#!/usr/bin/env python3
"""OptiML against llama.cpp (llama-cpp-python, the CPU peer) on the same GGUF file and thread count.

Both run llama-bench's two tests through their Python APIs, alternating runs so that drift on a shared
machine hits both alike: pp (one batch of --n-prompt tokens from an empty context) and tg (--n-gen
single-token steps from an empty context). Prints medians of --repeats runs and OptiML's ratio.

    pip install llama-cpp-python      # or: pip install ".[bench]"; builds llama.cpp, ~5 minutes
    python tools/bench_vs_llamacpp.py -m ~/.cache/optiml/models/SmolLM2-135M-Instruct.Q4_1.gguf -t 2
    python tools/bench_vs_llamacpp.py -m ~/.cache/optiml/models/gemma3-270m-Q4_K_M.gguf -t 2
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

import optiml
from optiml.cli import time_pp_tg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=5)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: pip install llama-cpp-python", file=sys.stderr)
        return 2

    n_ctx = max(args.n_prompt, args.n_gen) + 16
    ours = optiml.Model(args.model, n_ctx=n_ctx, n_threads=args.threads)
    peer = llama_cpp.Llama(args.model, n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                           n_batch=512, verbose=False)
    prompt = np.random.default_rng(0).integers(100, ours.n_vocab, args.n_prompt).tolist()
    time_pp_tg(ours, prompt, 8)  # warm up: page faults, thread pools
    time_pp_tg(peer, prompt, 8)
    res = {"optiml": [], "llama.cpp": []}
    for _ in range(args.repeats):
        res["optiml"].append(time_pp_tg(ours, prompt, args.n_gen))
        res["llama.cpp"].append(time_pp_tg(peer, prompt, args.n_gen))

    info = optiml.system_info()
    print(f"model: {args.model}")
    print(f"threads: {args.threads}, optiml simd: {info['simd']}, llama-cpp-python {llama_cpp.__version__}, "
          f"median of {args.repeats} runs (tokens/s)")
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in res.items()}
    print(f"| test    | {'optiml':>9} | {'llama.cpp':>9} | ratio |")
    print("|---------|-----------|-----------|-------|")
    for i, name in enumerate((f"pp{args.n_prompt}", f"tg{args.n_gen}")):
        a, b = med["optiml"][i], med["llama.cpp"][i]
        print(f"| {name:<7} | {a:9.2f} | {b:9.2f} | {a / b:5.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
