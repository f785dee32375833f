#!/usr/bin/env python3
"""Embeddings: OptiML's Model.embed against llama.cpp's (llama-cpp-python's Llama(embedding=True).embed) on the
same GGUF file, thread count, pooling and texts: a corpus cut into --texts pieces of --words words (the shared
evaluation text), as an indexing job for retrieval embeds it. Runs alternate between the engines; prints the
median texts/s of --repeats runs, OptiML's ratio, and the lowest cosine between the two engines' vectors.

    python tools/bench/embeddings.py                       # SmolLM2 Q4_1 from the cache, 2 threads
    python tools/bench/embeddings.py -m model.gguf -t 4 --texts 400 --words 40 --pooling last
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import harness
import optiml


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct-q4_1", help="a GGUF file or a known model name")
    ap.add_argument("-t", "--threads", type=harness.positive, default=2)
    ap.add_argument("--texts", type=harness.positive, default=200, help="texts per run (default 200)")
    ap.add_argument("--words", type=harness.positive, default=20, help="words per text (default 20)")
    ap.add_argument("--pooling", choices=("mean", "cls", "last"), default="mean")
    ap.add_argument("-r", "--repeats", type=harness.positive, default=3)
    args, res = harness.parse(ap, "embeddings")
    path = harness.model_arg(ap, args.model, pull=False)
    llama_cpp = harness.llama_cpp()
    with open(harness.TEXT, encoding="utf-8") as f:
        words = f.read().split()
    if len(words) < args.texts * args.words:
        ap.error(f"the text has {len(words)} words; --texts x --words asks for {args.texts * args.words}")
    texts = [" ".join(words[i * args.words:(i + 1) * args.words]) for i in range(args.texts)]

    ours = optiml.Model(path, n_ctx=512, n_threads=args.threads)
    kind = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
            "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}[args.pooling]
    peer = llama_cpp.Llama(path, embedding=True, pooling_type=kind, n_ctx=512, n_batch=512, n_threads=args.threads,
                           n_threads_batch=args.threads, verbose=False)
    vectors = {}

    def run(engine):
        t0 = time.perf_counter()
        if engine is ours:
            v = ours.embed(texts, pooling=args.pooling)
        else:
            v = np.array(peer.embed(texts, normalize=True), dtype=np.float32)
        seconds = time.perf_counter() - t0
        vectors[engine is ours] = v
        return len(texts) / seconds

    print(harness.machine_line() + f", threads: {args.threads}")
    runs = harness.alternate({"optiml": ours, "llama.cpp": peer}, {"embed": run}, args.repeats)
    a, b = harness.median(runs[("embed", "optiml")]), harness.median(runs[("embed", "llama.cpp")])
    cos = float((vectors[True] * vectors[False]).sum(1).min())
    res.add(model=os.path.basename(path), texts=args.texts, words=args.words, pooling=args.pooling, optiml=a,
            **{"llama.cpp": b}, ratio=a / b, min_cosine=cos)
    print(f"median of {args.repeats} runs, texts/s; {args.texts} texts of {args.words} words, {args.pooling} pooling\n")
    print(res.table(formats={"optiml": ".1f", "llama.cpp": ".1f", "ratio": ".2f", "min_cosine": ".5f"}))
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    harness.close(peer)
    ours.close()
    res.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
