#!/usr/bin/env python3
"""What Python costs per generated token: Model.stream against the native generation loop alone.

Three ways to generate the same tokens (same prompt, sampling parameters and seed), alternating runs so that
drift on a shared machine hits all alike, each from an empty context:

  stream  Model.stream, iterated from Python (what users run). Its own statistics split its wall time
          into the prompt, the native loop's busy time (eval + sampling + detokenization + stop strings,
          timed inside C++) and the rest: the Python overhead (iterator, GIL hand-over, str objects,
          setup and teardown of the stream).
  native  the same optiml._core.Generator run to the end in one native call (no Python per token).
  python  the loop as it was before it went native: Model.eval, Sampler, Detokenizer and find_stop per
          token in Python (for comparison).

Prints medians over --repeats runs of the generation time per token (prompt excluded) and the overhead
as a share of a token's time: in-run (stream's non-native part / stream's time per token) and
between runs (stream / native - 1; noisier, as it compares separate runs).

    python tools/bench/generate_overhead.py                       # SmolLM2-135M-Instruct Q4_1, 2 threads
    python tools/bench/generate_overhead.py -m model.gguf -t 4 -n 256 -r 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import harness
import optiml
from optiml import _core

_sampling = harness.internal("sampling")
Sampler, SamplingParams, find_stop = _sampling.Sampler, _sampling.SamplingParams, _sampling.find_stop

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def run_stream(m: optiml.Model, kw: dict) -> dict:
    m.reset()
    t0 = time.perf_counter()
    for _ in m.stream(PROMPT, **kw):
        pass
    wall = time.perf_counter() - t0
    st = m.last_stats
    gen = wall - st["prompt_s"]
    return {"n": st["gen_tokens"], "gen_s": gen, "overhead_s": gen - st["busy_s"]}


def run_native(m: optiml.Model, kw: dict) -> dict:
    m.reset()
    kw = dict(kw)
    max_tokens, stops = kw.pop("max_tokens"), kw.pop("stop", None) or []
    t0 = time.perf_counter()
    ids = m.tokenize(PROMPT, special=True)
    sampler = Sampler(m.n_vocab, SamplingParams(**kw))
    g = _core.Generator(m._session, m.tokenizer._t, sampler._s, np.array(ids, np.int32), 0, max_tokens,
                        [s.encode() for s in stops])
    g.run_to_end()
    wall = time.perf_counter() - t0
    st = g.stats
    return {"n": st["gen_tokens"], "gen_s": wall - st["prompt_s"]}


def run_python(m: optiml.Model, kw: dict) -> dict:
    """The former Python loop (Model.stream before the native generator), stops included."""
    m.reset()
    kw = dict(kw)
    max_tokens, stops = kw.pop("max_tokens"), kw.pop("stop", None) or []
    ids = m.tokenize(PROMPT, special=True)
    sampler = Sampler(m.n_vocab, SamplingParams(**kw))
    t0 = time.perf_counter()
    logits = m.eval(ids)
    t1 = time.perf_counter()
    sampler.accept(ids)
    detok = m.tokenizer.detokenizer()
    pending, n = "", 0
    for i in range(max_tokens):
        tok = sampler.sample(logits)
        if m.tokenizer.is_eog(tok):
            break
        sampler.accept(tok)
        n += 1
        pending += detok.push(tok)
        if stops:
            at, hold = find_stop(pending, stops)
            if at >= 0:
                break
            pending = pending[len(pending) - hold :]
        else:
            pending = ""
        if i + 1 == max_tokens or m.n_past >= m.n_ctx:
            break
        logits = m.eval([tok])
    pending += detok.flush()
    return {"n": n, "gen_s": time.perf_counter() - t1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct", help="a GGUF file or a known model name")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-gen", type=int, default=128, help="tokens to generate per run")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--stop", action="append", help="a stop string (repeatable; exercises the hold-back)")
    args, res = harness.parse(ap, "generate_overhead")

    m = optiml.Model(args.model, n_ctx=args.n_gen + 64, n_threads=args.threads)
    kw = dict(max_tokens=args.n_gen, temperature=0.8, seed=1234, repeat_penalty=1.1, stop=args.stop)
    runs = {"stream": [], "native": [], "python": []}
    fns = {"stream": run_stream, "native": run_native, "python": run_python}
    for name, fn in fns.items():  # warm-up
        fn(m, kw)
    for _ in range(args.repeats):
        for name, fn in fns.items():
            runs[name].append(fn(m, kw))

    n = {r["n"] for rs in runs.values() for r in rs}
    assert len(n) == 1, f"the runs generated different token counts: {n}"
    n = n.pop()
    per_tok = {k: statistics.median(r["gen_s"] / r["n"] for r in rs) for k, rs in runs.items()}
    in_run = statistics.median(r["overhead_s"] / r["gen_s"] for r in runs["stream"])
    over_tok = statistics.median(r["overhead_s"] / r["n"] for r in runs["stream"])

    print(f"{m.path}: {args.threads} threads, {n} tokens per run, medians of {args.repeats} runs")
    for k in ("stream", "native", "python"):
        res.add(loop=k, ms_per_token=per_tok[k] * 1e3, tokens_s=1 / per_tok[k],
                vs_native=per_tok[k] / per_tok["native"] - 1, stream_overhead_in_run=in_run if k == "stream" else None)
        print(f"  {k:7s} {per_tok[k] * 1e3:8.3f} ms/token  {1 / per_tok[k]:7.1f} tokens/s")
    print(f"  Python overhead of Model.stream, in-run:      {over_tok * 1e6:7.1f} us/token = {in_run * 100:.2f}% "
          f"of a token's time")
    print(f"  Model.stream vs the native loop, across runs: {(per_tok['stream'] / per_tok['native'] - 1) * 100:+.2f}%")
    print(f"  the former Python loop vs the native loop:    {(per_tok['python'] / per_tok['native'] - 1) * 100:+.2f}%")
    print(f"  goal: under 2% -> {'met' if in_run < 0.02 else 'NOT met'}")
    res.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
