#!/usr/bin/env python3
"""OptiML against llama.cpp (llama-cpp-python, the CPU peer) on the same GGUF files and thread count.

For each model both engines run llama-bench's tests through their Python APIs: ppN (one batch of N
prompt tokens from an empty context) for every --n-prompt, and tgN (N single-token steps from an empty
context). Runs alternate between the engines (and which goes first), so drift on a shared machine hits
both alike. Prints the median tokens/s of --repeats runs of each test, OptiML's ratio, the CPU name
and the machine's load average (a busy machine makes every number noisy, llama.cpp's spinning
OpenMP threads more than most).

    pip install llama-cpp-python      # or: pip install ".[bench]"; builds llama.cpp, ~5 minutes
    python tools/bench_vs_llamacpp.py                       # SmolLM2 Q4_1 and Gemma 3 Q4_K_M from the cache
    python tools/bench_vs_llamacpp.py -m model.gguf -t 4 -p 128 512 -n 128 -r 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

import optiml
from optiml import models

DEFAULT_MODELS = ["smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_pp(engine, prompt: list[int]) -> float:
    engine.reset()
    t0 = time.perf_counter()
    engine.eval(prompt)
    return len(prompt) / (time.perf_counter() - t0)


def time_tg(engine, token: int, n: int) -> float:
    engine.reset()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.eval([token])
    return n / (time.perf_counter() - t0)


def bench_model(path: str, args, llama_cpp) -> list[tuple[str, float, float]]:
    n_ctx = max(max(args.n_prompt), args.n_gen) + 16
    ours = optiml.Model(path, n_ctx=n_ctx, n_threads=args.threads)
    peer = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                           n_batch=max(512, max(args.n_prompt)), verbose=False)
    rng = np.random.default_rng(0)
    prompts = {p: rng.integers(100, ours.n_vocab, p).tolist() for p in args.n_prompt}
    tests = [(f"pp{p}", (lambda e, p=p: time_pp(e, prompts[p]))) for p in args.n_prompt]
    tests.append((f"tg{args.n_gen}", lambda e: time_tg(e, prompts[args.n_prompt[0]][0], args.n_gen)))
    engines = {"optiml": ours, "llama.cpp": peer}
    for _, run in tests:  # warm up: page faults, thread pools, first-call allocations
        for e in engines.values():
            run(e)
    res = {(name, k): [] for name, _ in tests for k in engines}
    for rep in range(args.repeats):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name, run in tests:
            for k in order:
                res[(name, k)].append(run(engines[k]))
    del ours, peer
    return [(name, statistics.median(res[(name, "optiml")]), statistics.median(res[(name, "llama.cpp")]))
            for name, _ in tests]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", nargs="*", default=None,
                    help="GGUF files or known model names (default: " + ", ".join(DEFAULT_MODELS) + ")")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, nargs="*", default=[128, 512])
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=5)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: pip install llama-cpp-python", file=sys.stderr)
        return 2

    paths = []
    for m in args.model or DEFAULT_MODELS:
        p = str(models.model_file(m)) if models.lookup(m) else m
        if not os.path.exists(p):
            print(f"{p}: no such file (for a known model run: optiml pull {m})", file=sys.stderr)
            return 2
        paths.append(p)

    info = optiml.system_info()
    print(f"cpu: {cpu_name()}, optiml simd: {info['simd']}, threads: {args.threads}, "
          f"llama-cpp-python {llama_cpp.__version__}")
    print(f"median of {args.repeats} runs, tokens/s; load average before: {os.getloadavg()[0]:.1f}")
    print()
    print(f"| {'model':<34} | {'test':<6} | {'optiml':>9} | {'llama.cpp':>9} | {'ratio':>5} |")
    print(f"|{'-' * 36}|{'-' * 8}|{'-' * 11}|{'-' * 11}|{'-' * 7}|")
    for path in paths:
        for name, a, b in bench_model(path, args, llama_cpp):
            print(f"| {os.path.basename(path):<34} | {name:<6} | {a:9.1f} | {b:9.1f} | {a / b:5.2f} |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
