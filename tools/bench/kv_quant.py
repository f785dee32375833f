#!/usr/bin/env python3
"""Decode speed with a quantized KV cache (issue #47): tokens/s of single-sequence decoding at a deep
position (4k by default), the cache f16, q8_0 or q4_0 (keys and values alike), OptiML beside llama.cpp
(llama-cpp-python, flash attention on: llama.cpp needs it for a quantized V cache) with the same types.

Every engine/type pair gets its own context, filled once with --depth tokens of real text. Then, rep after
rep and pair after pair (alternated, so every pair sees the same phases of a shared machine), the context
is cut back to --depth and --tokens decode steps run one token each; their time alone is measured. The
tokens fed are fixed (the text's own next tokens), so every pair does the same work. Medians are reported,
and each ratio is the median of per-rep ratios against the same engine's f16.

    python tools/bench/kv_quant.py                    # SmolLM2 Q4_1, 2 threads, 4096 positions
    python tools/bench/kv_quant.py -m MODEL.gguf --depth 2048 --tokens 32 --reps 5

Goal (issue 47): q8_0 decodes no slower than f16 at 4k positions on the CPU with 2 threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import harness  # noqa: E402  (tools/bench/: optiml importable, timing, the peer, the machine)

import optiml  # noqa: E402
from optiml.tokenizer import Tokenizer  # noqa: E402

cpu_name = harness.cpu_name

TYPES = ["f16", "q8_0", "q4_0"]


class OptimlRunner:
    def __init__(self, path, kv, n_ctx, threads):
        self.m = optiml.Model(path, n_ctx=n_ctx, n_threads=threads, kv_type=kv)

    def fill(self, ids):
        self.m.eval(ids)

    def steps(self, depth, ids):
        self.m.kv_truncate(0, depth)
        t0 = time.perf_counter()
        for i, tok in enumerate(ids):
            self.m.decode(optiml.Batch().add(tok, 0, depth + i, logits=True))
        return time.perf_counter() - t0

    def close(self):
        self.m.close()


class LlamaRunner:
    def __init__(self, path, kv, n_ctx, threads):
        llama_cpp = harness.llama_cpp()
        t = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}[kv]
        self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                                   type_k=t, type_v=t, flash_attn=True, verbose=False)

    def fill(self, ids):
        self.llm.eval(ids)

    def steps(self, depth, ids):
        self.llm.n_tokens = depth  # eval() removes the cache past n_tokens first
        t0 = time.perf_counter()
        for tok in ids:
            self.llm.eval([tok])
        return time.perf_counter() - t0

    def close(self):
        self.llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct-q4_1", help="a GGUF file or a known model name")
    ap.add_argument("-t", "--threads", type=harness.positive, default=2)
    ap.add_argument("--depth", type=harness.positive, default=4096, help="positions in the cache when decoding starts")
    ap.add_argument("--tokens", type=harness.positive, default=32, help="decode steps per rep")
    ap.add_argument("--reps", type=harness.positive, default=5)
    ap.add_argument("--no-llama", action="store_true", help="OptiML only (no llama-cpp-python needed)")
    args, res = harness.parse(ap, "kv_quant")
    path = harness.model_arg(ap, args.model)
    if not args.no_llama:
        harness.llama_cpp(instead="--no-llama: OptiML alone")  # exits with how to install it when missing
    n_ctx = args.depth + args.tokens
    tok = Tokenizer.from_file(path)
    ids = tok.encode(harness.TEXT.read_text(encoding="utf-8"))
    while len(ids) < n_ctx:
        ids = ids + ids
    fill, steps = ids[:args.depth], ids[args.depth:n_ctx]

    engines = [("optiml", OptimlRunner)] + ([] if args.no_llama else [("llama.cpp", LlamaRunner)])
    runners = {}
    for name, cls in engines:
        for kv in TYPES:
            r = cls(path, kv, n_ctx, args.threads)
            t0 = time.perf_counter()
            r.fill(fill)
            print(f"{name:9s} {kv:5s} filled {args.depth} positions in {time.perf_counter() - t0:.1f} s", flush=True)
            runners[name, kv] = r

    times = {k: [] for k in runners}
    for rep in range(args.reps):
        for k, r in runners.items():
            times[k].append(r.steps(args.depth, steps))
        print(f"rep {rep + 1}/{args.reps}: " + "  ".join(f"{n}/{kv} {args.tokens / times[n, kv][-1]:.1f}"
                                                          for n, kv in runners), flush=True)

    print(f"\n{os.path.basename(path)}, {cpu_name()}, {args.threads} threads: decode at {args.depth} positions, "
          f"{args.tokens} tokens x {args.reps} reps (median tok/s)")
    print(f"{'engine':10s} {'kv':5s} {'tok/s':>8s} {'vs f16':>7s}" + ("" if args.no_llama else f" {'vs llama.cpp':>13s}"))
    for name, _ in engines:
        for kv in TYPES:
            tps = args.tokens / statistics.median(times[name, kv])
            vs_f16 = statistics.median(f / t for f, t in zip(times[name, "f16"], times[name, kv]))
            line = f"{name:10s} {kv:5s} {tps:8.1f} {vs_f16:7.3f}"
            row = res.add(engine=name, kv=kv, tok_s=tps, runs=[args.tokens / t for t in times[name, kv]],
                          vs_f16=vs_f16)
            if not args.no_llama:
                vs_llama = statistics.median(lt / t for lt, t in zip(times["llama.cpp", kv], times[name, kv]))
                line += f" {vs_llama:13.3f}"
                row["vs_llama_cpp"] = vs_llama
            print(line)
    for r in runners.values():
        r.close()
    res.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
