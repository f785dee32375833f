#!/usr/bin/env python3
"""CPU decode attention over the paged host KV cache (optiml._core.PagedKV): time per step by batch size and
KV length, and the KV bytes read per second against this machine's read bandwidth. These are the CPU
attention costs NEO's scheduler (issue #19) weighs against the GPU's.

    python tools/bench/paged_attention.py -t 2 [--shape 7b] [--lengths 256 1024 4096] [--batch 1 8 32]

One layer of a shape (7b: 32 query heads of 128 over 32 KV heads; 8b: 32 over 8), each sequence holding the
given number of positions; medians of --reps runs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import harness
from optiml import _core

SHAPES = {"7b": (32, 32, 128), "8b": (32, 8, 128), "small": (9, 3, 64)}  # n_head, n_head_kv, head_dim


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=_core.physical_core_count())
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=5)
    args, res = harness.parse(ap, "paged_attention")
    n_head, n_head_kv, hd = SHAPES[args.shape]
    width = n_head_kv * hd
    read_bw = _core.measure_read_bandwidth(1 << 30, 3, args.threads)
    rng = np.random.default_rng(0)
    print(f"shape {args.shape}: {n_head} query heads, {n_head_kv} KV heads of {hd}; {args.threads} threads; "
          f"read bandwidth {read_bw / 1e9:.1f} GB/s")
    print(f"{'batch':>5} {'kv len':>7} {'ms/step':>8} {'us/token':>9} {'KV GB/s':>8} {'of read bw':>10}")
    for n_kv in args.lengths:
        for n in args.batch:
            kv = _core.PagedKV(1, n_head_kv, hd, n * -(-n_kv // 32))  # blocks of 32 positions
            k = rng.standard_normal((n_kv, width)).astype(np.float32)
            v = rng.standard_normal((n_kv, width)).astype(np.float32)
            for s in range(n):
                for p in range(n_kv):
                    kv.store(0, s, p, k[p], v[p])
            q = rng.standard_normal((n, n_head * hd)).astype(np.float32)
            seq = np.arange(n, dtype=np.int32)
            pos = np.full(n, n_kv - 1, np.int32)
            dt = harness.per_call(lambda i: kv.attend(0, q, seq, pos, 1 / np.sqrt(hd), n_threads=args.threads),
                                  1, args.reps)
            read = 2 * n * n_kv * width * 2  # K and V in f16, once per KV head (its query heads share it)
            res.add(batch=n, kv_len=n_kv, ms_step=dt * 1e3, us_token=dt / n * 1e6, kv_gb_s=read / dt / 1e9,
                    of_read_bandwidth=read / dt / read_bw)
            print(f"{n:5d} {n_kv:7d} {dt * 1e3:8.3f} {dt / n * 1e6:9.1f} {read / dt / 1e9:8.2f} "
                  f"{read / dt / read_bw:10.0%}", flush=True)
    res.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
