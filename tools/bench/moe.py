#!/usr/bin/env python3
"""Mixture-of-experts speed on the CPU, OptiML against llama.cpp (llama-cpp-python) on the same file, same
thread count, in one run (issue 46, item 7, the CPU half).

The model is Qwen3-30B-A3B-shaped (n_embd 2048, 32/4 heads of 128, 128 experts of 768, 8 used, Q4_K
experts and attention, Q6_K output), or with --shape gpt-oss-20b gpt-oss-20b-shaped (n_embd 2880, 64/8
heads of 64, 32 experts of 2880, 4 used, MXFP4 experts and Q8_0 elsewhere as OpenAI ships it), with
--n-layer layers instead of 48 / 24 so it fits here, random weights and skewed expert popularity planted
(tools/make_synthetic_model.py --plant-experts): written to --model when missing (~0.7 GB for 2 Qwen3
layers, about 5 minutes on 2 busy cores; ~0.45 GB a gpt-oss layer).

  decode  a 16-token prompt, then --n-gen tokens fed one at a time (teacher forcing: both engines do the
          same work); tokens/s of those steps.
  prompt  --n-prompt tokens from an empty context in one eval (batches of 512); tokens/s.
Median of --repeats runs, OptiML and llama.cpp alternating so that drift on a shared machine hits both.
Goals (issue 46, 48 layers): decode >= 1.2x llama.cpp, prompt >= 1.5x; with fewer layers the step's fixed
costs (embedding, output) weigh more than in the real model.

    PYTHONPATH=python python tools/bench/moe.py --threads 2
    PYTHONPATH=python python tools/bench/moe.py --threads 2 --shape gpt-oss-20b --n-layer 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import harness  # tools/bench/: makes optiml importable; the peer, --json

import optiml

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/, where make_synthetic_model.py is
DEFAULT_MODEL = str(harness.internal("models").cache_dir() / "synthetic" / "qwen3moe-30b-a3b-shape-2l-q4_k.gguf")
GOALS = {"decode": 1.2, "prompt": 1.5}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# The model shapes a file is written in (tools/make_synthetic_model.py arguments, --n-layer apart).
SHAPES = {
    # Qwen3-30B-A3B: 128 experts of 768, 8 used; Q4_K experts and attention, Q6_K output (48 layers)
    "qwen3-30b-a3b": ["--arch", "qwen3moe", "--n-embd", "2048", "--n-head", "32", "--n-head-kv", "4", "--head-dim",
                      "128", "--experts", "128", "--experts-used", "8", "--n-ff-exp", "768", "--n-ff", "6144",
                      "--type", "q4_k", "--output-type", "q6_k"],
    # gpt-oss-20b as OpenAI ships it: 32 experts of 2880, 4 used, MXFP4 experts, Q8_0 elsewhere; 64/8 heads of
    # 64, a window of 128 on even layers, YaRN (24 layers)
    "gpt-oss-20b": ["--arch", "gpt-oss", "--n-embd", "2880", "--n-head", "64", "--n-head-kv", "8", "--head-dim", "64",
                    "--experts", "32", "--experts-used", "4", "--n-ff-exp", "2880", "--n-ff", "2880", "--type", "q8_0",
                    "--expert-type", "mxfp4", "--output-type", "q8_0", "--sliding-window", "128"],
}


def make_model(path: str, n_layer: int, alpha: float, tokenizer_from: str | None = None,
               shape: str = "qwen3-30b-a3b") -> None:
    cmd = [sys.executable, os.path.join(HERE, "make_synthetic_model.py"), "-o", path, *SHAPES[shape],
           "--n-layer", str(n_layer), "--plant-experts", str(alpha), "--quiet"]
    if tokenizer_from:
        cmd += ["--tokenizer-from", tokenizer_from]
    log("writing " + path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:  # its error is on the terminal already: one line more, no traceback
        raise SystemExit(f"writing {path} failed (exit {r.returncode}): tools/make_synthetic_model.py's error is above")


def tokens(n: int, n_vocab: int) -> list[int]:
    return [(i * 7919) % (n_vocab - 300) + 300 for i in range(n)]


class OptiML:
    name = "optiml"

    def __init__(self, path, n_ctx, threads):
        self.m = optiml.Model(path, n_ctx=n_ctx, n_threads=threads, n_batch=512)

    def reset(self):
        self.m.reset()

    def eval(self, ids):
        self.m.eval(ids)


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path, n_ctx, threads):
        self.m = harness.llama_cpp().Llama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                           n_batch=512, n_ubatch=512, verbose=False)

    def reset(self):
        self.m.reset()

    def eval(self, ids):
        self.m.eval(ids)


def decode_tps(e, prompt, gen) -> float:
    e.reset()
    e.eval(prompt)
    t0 = time.perf_counter()
    for t in gen:
        e.eval([t])
    return len(gen) / (time.perf_counter() - t0)


def prompt_tps(e, ids) -> float:
    e.reset()
    t0 = time.perf_counter()
    e.eval(ids)
    return len(ids) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the GGUF to run (written here in --shape when missing; default: "
                    "a file per shape and layer count in the model cache's synthetic/)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--n-layer", type=harness.positive, default=2,
                    help="layers of a model written here (Qwen3-30B-A3B has 48)")
    ap.add_argument("--plant-experts", type=float, default=1.0, help="popularity skew of a model written here")
    ap.add_argument("--threads", type=harness.positive, default=2)
    ap.add_argument("--n-gen", type=harness.positive, default=32)
    ap.add_argument("--n-prompt", type=harness.positive, default=512)
    ap.add_argument("--repeats", type=harness.positive, default=3)
    ap.add_argument("--only", choices=("decode", "prompt"), default=None)
    a, res = harness.parse(ap, "moe", argv)
    harness.llama_cpp()  # the peer is half of every row: exits with how to install it, before writing a model
    if a.model is None:
        a.model = DEFAULT_MODEL if a.shape == "qwen3-30b-a3b" and a.n_layer == 2 else str(
            harness.internal("models").cache_dir() / "synthetic" / f"{a.shape}-shape-{a.n_layer}l.gguf")
    if not os.path.exists(a.model):
        make_model(a.model, a.n_layer, a.plant_experts, shape=a.shape)

    n_ctx = max(a.n_prompt, 16 + a.n_gen) + 16
    engines = [OptiML(a.model, n_ctx, a.threads), LlamaCpp(a.model, n_ctx, a.threads)]
    n_vocab = engines[0].m.n_vocab
    hp = engines[0].m.hparams
    log(f"{os.path.basename(a.model)}: {hp['arch']}, {hp['n_layer']} layers, {hp['n_expert']} experts of "
        f"{hp['n_ff_exp']} ({hp['n_expert_used']} used), {a.threads} threads")
    ids = tokens(max(a.n_prompt, 16 + a.n_gen), n_vocab)
    results, runs_of = {}, {}
    for what in ("decode", "prompt"):
        if a.only and what != a.only:
            continue
        runs = {e.name: [] for e in engines}
        for e in engines:  # warm-up: pages in the weights the run reads
            decode_tps(e, ids[:16], ids[16:20]) if what == "decode" else prompt_tps(e, ids[:64])
        for r in range(a.repeats):
            for e in engines:
                tps = decode_tps(e, ids[:16], ids[16 : 16 + a.n_gen]) if what == "decode" else prompt_tps(e, ids[: a.n_prompt])
                runs[e.name].append(tps)
                log(f"{what} run {r + 1}: {e.name} {tps:.2f} tokens/s")
        results[what] = {k: statistics.median(v) for k, v in runs.items()}
        runs_of[what] = runs

    print(f"\n{os.path.basename(a.model)}, {a.threads} threads, median of {a.repeats}")
    print(f"{'':8s} {'optiml t/s':>11s} {'llama.cpp t/s':>14s} {'ratio':>7s} {'goal':>6s}")
    for what, r in results.items():
        ratio = r["optiml"] / r["llama.cpp"]
        res.add(model=os.path.basename(a.model), test=what, optiml=r["optiml"], optiml_runs=runs_of[what]["optiml"],
                llama_cpp=r["llama.cpp"], llama_cpp_runs=runs_of[what]["llama.cpp"], ratio=ratio, goal=GOALS[what])
        print(f"{what:8s} {r['optiml']:11.2f} {r['llama.cpp']:14.2f} {ratio:6.2f}x {GOALS[what]:5.1f}x")
    res.write(a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
