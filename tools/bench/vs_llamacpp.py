#!/usr/bin/env python3
"""OptiML against llama.cpp (llama-cpp-python, the CPU peer) on the same GGUF files and thread count.

For each model both engines run llama-bench's tests through their Python APIs: ppN (one batch of N
prompt tokens from an empty context) for every --n-prompt, tgN (N single-token steps from an empty
context) and, for every --depth D, tgN@dD (N steps after a context of D tokens, as llama-bench -d: what
decoding costs once attention reads a long cache). Runs alternate between the engines (and which goes
first), so drift on a shared machine hits both alike. Prints the median tokens/s of --repeats runs of each test, OptiML's ratio, the CPU name
and the machine's load average (a busy machine makes every number noisy, llama.cpp's spinning
OpenMP threads more than most).

    pip install llama-cpp-python      # or: pip install ".[bench]"; builds llama.cpp, ~5 minutes
    python tools/bench/vs_llamacpp.py                       # SmolLM2 Q4_1 and Gemma 3 Q4_K_M from the cache
    python tools/bench/vs_llamacpp.py -m model.gguf -t 4 -p 128 512 -n 128 -r 5
    python tools/bench/vs_llamacpp.py -p 128 -n 32 -d 2048          # decode after 2048 tokens of context
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import harness
import optiml

DEFAULT_MODELS = ["smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"]


def bench_model(path: str, args) -> list[dict]:
    """Rows of (model, test, optiml, llama.cpp, ratio): medians of args.repeats alternated runs."""
    n_ctx = max(max(args.n_prompt), args.n_gen + max(args.depth, default=0)) + 16
    ours = optiml.Model(path, n_ctx=n_ctx, n_threads=args.threads)
    peer = harness.load_peer(path, n_ctx, args.threads, n_batch=max(512, max(args.n_prompt)))
    rng = np.random.default_rng(0)
    prompts = {p: rng.integers(100, ours.n_vocab, p).tolist() for p in args.n_prompt}
    tests = {f"pp{p}": (lambda e, p=p: harness.time_pp(e, prompts[p])) for p in args.n_prompt}
    tests[f"tg{args.n_gen}"] = lambda e: harness.time_tg(e, prompts[args.n_prompt[0]][0], args.n_gen)
    for d in args.depth:
        context = rng.integers(100, ours.n_vocab, d).tolist()
        tests[f"tg{args.n_gen}@d{d}"] = lambda e, c=context: harness.time_tg_at_depth(e, c, c[0], args.n_gen)
    runs = harness.alternate({"optiml": ours, "llama.cpp": peer}, tests, args.repeats)
    del ours, peer
    rows = []
    for t in tests:
        a, b = harness.median(runs[(t, "optiml")]), harness.median(runs[(t, "llama.cpp")])
        rows.append({"model": os.path.basename(path), "test": t, "optiml": a, "llama.cpp": b, "ratio": a / b})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", nargs="+", default=None,
                    help="GGUF files or known model names (default: " + ", ".join(DEFAULT_MODELS) + ")")
    ap.add_argument("-t", "--threads", type=harness.positive, default=2)
    ap.add_argument("-p", "--n-prompt", type=harness.positive, nargs="+", default=[128, 512])
    ap.add_argument("-n", "--n-gen", type=harness.positive, default=128)
    ap.add_argument("-d", "--depth", type=harness.positive, nargs="+", default=[],
                    help="also tgN after a context of D tokens, for each D (llama-bench -d)")
    ap.add_argument("-r", "--repeats", type=harness.positive, default=5)
    args, res = harness.parse(ap, "vs_llamacpp")
    paths = [harness.model_arg(ap, m, pull=False) for m in args.model or DEFAULT_MODELS]
    harness.llama_cpp()  # exits with how to install it when missing

    print(harness.machine_line() + f", threads: {args.threads}")
    print(f"median of {args.repeats} runs, tokens/s")
    print()
    for path in paths:
        for row in bench_model(path, args):
            res.add(**row)
            print(f"{row['model']} {row['test']}: {row['optiml']:.1f} vs {row['llama.cpp']:.1f}", flush=True)
    print()
    print(res.table(formats={"optiml": ".1f", "llama.cpp": ".1f", "ratio": ".2f"}))
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    res.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
