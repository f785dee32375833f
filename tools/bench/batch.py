#!/usr/bin/env python3
"""Batched generation: N sequences decoded together, aggregate generation tokens/s, OptiML against
llama.cpp's own batched decoding (llama-cpp-python's low-level llama_batch API), side by side in one run.

Each round: N different prompts (short, so generation dominates) are evaluated, then `--tokens` decode
steps advance all N sequences at once (one token each per step, greedy); the time of the decode steps
alone is measured. Rounds go N after N and engine after engine, rep after rep, so every N sees the same
phases of a shared machine; medians are reported, and each scaling is the median of per-rep ratios.

    python tools/bench/batch.py                       # SmolLM2 Q4_1, 2 threads, N = 1 4 8 16
    python tools/bench/batch.py -m MODEL.gguf -n 1 8 --tokens 64 --reps 3

Prints a table: tokens/s aggregate for each N, the ratio OptiML / llama.cpp, and each engine's scaling
(N sequences vs one). Goal (issue 13): at N = 8, OptiML >= 4x its own N = 1, and >= 1.3x llama.cpp.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np

import harness
import optiml

PROMPTS = ["The capital of France is", "Once upon a time", "In the beginning", "The best way to learn",
           "def fibonacci(n):", "Water boils at", "My favourite book", "The history of Rome",
           "A recipe for bread", "The moon is", "Photosynthesis is", "To be or not to be",
           "The quick brown fox", "Machine learning is", "Dear diary,", "The weather today"]


def optiml_round(m: optiml.Model, prompts: list[list[int]], steps: int) -> float:
    n = len(prompts)
    m.kv_clear()
    b = optiml.Batch()
    for s, p in enumerate(prompts):
        b.add_sequence(p, seq=s)
    logits = m.decode(b)
    nxt = logits.argmax(1)
    pos = [len(p) for p in prompts]
    t0 = time.perf_counter()
    for _ in range(steps):
        b.clear()
        for s in range(n):
            b.add(int(nxt[s]), s, pos[s], logits=True)
            pos[s] += 1
        nxt = m.decode(b).argmax(1)
    return time.perf_counter() - t0


_quiet = None


class LlamaBatched:
    """llama.cpp with n_seq_max sequences, driven through llama_batch as its batched examples do."""

    def __init__(self, path: str, n_seq: int, n_ctx_seq: int, threads: int):
        L = harness.llama_cpp()
        self.L = L
        global _quiet
        _quiet = L.llama_log_callback(lambda level, text, user: None)  # kept alive: llama.cpp holds it
        L.llama_log_set(_quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_seq * n_ctx_seq
        cp.n_batch = max(512, n_seq * 64)
        cp.n_ubatch = cp.n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(cp.n_batch, 0, n_seq)

    def _decode(self, items) -> None:
        """items: (token, seq, pos, wants logits)."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, s, p, lg) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = p
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = s
            b.logits[i] = 1 if lg else 0
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        return int(arr.argmax())

    def round(self, prompts: list[list[int]], steps: int) -> float:
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        items = []
        outs = []
        for s, p in enumerate(prompts):
            for i, t in enumerate(p):
                last = i == len(p) - 1
                if last:
                    outs.append(len(items))
                items.append((t, s, i, last))
        self._decode(items)
        nxt = [self._argmax(i) for i in outs]
        pos = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(steps):
            items = [(nxt[s], s, pos[s], True) for s in range(len(prompts))]
            self._decode(items)
            nxt = [self._argmax(i) for i in range(len(prompts))]
            pos = [q + 1 for q in pos]
        return time.perf_counter() - t0

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct", help="a GGUF file or a known model name")
    ap.add_argument("-n", "--n-seq", type=harness.positive, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("-t", "--threads", type=harness.positive, default=2)
    ap.add_argument("--tokens", type=harness.positive, default=32, help="decode steps per round")
    ap.add_argument("--reps", type=harness.positive, default=3, help="rounds per engine and N (medians reported)")
    ap.add_argument("--no-peer", action="store_true", help="OptiML only (no llama-cpp-python needed)")
    a, res = harness.parse(ap, "batch", argv)
    path = harness.model_arg(ap, a.model)
    if not a.no_peer:
        harness.llama_cpp(instead="--no-peer: OptiML alone")  # exits with how to install it when missing
    n_ctx_seq = 128

    print(f"model: {os.path.basename(path)}; CPU: {harness.cpu_name()}; threads: {a.threads}; "
          f"simd: {optiml.system_info()['simd']}; {a.tokens} decode steps per round, {a.reps} rounds, medians")
    # Every engine and N is loaded first, then the rounds go N after N, engine after engine, rep after
    # rep: on a shared machine whose speed drifts, each N then sees the same phases, and a round's
    # scaling is taken against the N = 1 round of the same rep (paired), not against another minute.
    setups = []
    for n in a.n_seq:
        m = optiml.Model(path, n_ctx=n_ctx_seq, n_threads=a.threads, n_seq=n, sparsity="none")
        prompts = [m.tokenize(PROMPTS[s % len(PROMPTS)]) for s in range(n)]
        peer = None if a.no_peer else LlamaBatched(path, n, n_ctx_seq, a.threads)
        optiml_round(m, prompts, 2)  # warm-up
        if peer:
            peer.round(prompts, 2)
        setups.append((n, m, prompts, peer))
    ours = {n: [] for n in a.n_seq}
    theirs = {n: [] for n in a.n_seq}
    for _ in range(a.reps):
        for n, m, prompts, peer in setups:
            ours[n].append(n * a.tokens / optiml_round(m, prompts, a.tokens))
            if peer:
                theirs[n].append(n * a.tokens / peer.round(prompts, a.tokens))
    for n, m, _, peer in setups:
        m.close()
        if peer:
            peer.close()

    def med(xs):
        return statistics.median(xs) if xs else None

    def paired(runs, n):  # median over reps of (N's round / the same rep's N = 1 round); None without N = 1
        if not runs.get(1) or not runs[n]:
            return None
        return med([x / one for x, one in zip(runs[n], runs[1])])

    def cell(v):  # a scaling cell; "-" where there is none (no N = 1 round)
        return "-" if v is None else f"{v:.2f}x"

    peer = not a.no_peer
    print()
    print("| N | optiml tok/s (range) | " + ("llama.cpp tok/s | optiml / llama.cpp | " if peer else "")
          + "optiml scaling vs N=1 |" + (" llama.cpp scaling |" if peer else ""))
    print("|---|---|---|" + ("---|---|---|" if peer else ""))
    for n in a.n_seq:
        o = med(ours[n])
        row = dict(model=os.path.basename(path), n_seq=n, optiml=o, optiml_runs=ours[n], scaling=paired(ours, n))
        line = f"| {n} | {o:.1f} ({min(ours[n]):.1f}-{max(ours[n]):.1f}) | "
        if peer:
            t = med(theirs[n])
            row.update(llama_cpp=t, llama_cpp_runs=theirs[n], ratio=o / t, llama_cpp_scaling=paired(theirs, n))
            line += f"{t:.1f} | {o / t:.2f}x | "
        line += f"{cell(row['scaling'])} |" + (f" {cell(row['llama_cpp_scaling'])} |" if peer else "")
        print(line)
        res.add(**row)
    print("\nscaling: the median over rounds of a round's tok/s against the N = 1 round of the same rep")
    res.write(a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
