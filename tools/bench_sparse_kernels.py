#!/usr/bin/env python3
"""Throughput of the sparse FFN kernels (native/src/cpu/sparse*.cpp) on a 7B-shaped layer.

  * axpy_rows (column-sparse down): --active of the n_ff neuron-major rows, each dim values of
    F32/F16/Q8_0, accumulated into y; throughput is the neuron-row bytes read per second;
  * matmul_rows (row-sparse gate/up): the same fraction of the n_ff rows of a --gate-type matrix;
  * the engine's down copy of a --gate-type matrix, grouped (lossless, Q4_0/Q4_1/Q4_K) against 8-bit
    rows: time per call for the same neurons, and the ratio;
  * repack_neuron_major: seconds to repack one down matrix, and that times --layers.

Copies of the weights spanning --span MiB are cycled through, so rows come from memory, not cache,
as in decoding a real model. The fraction is throughput over the memory read bandwidth measured in
the same run with the same thread count.

    python tools/bench_sparse_kernels.py
    python tools/bench_sparse_kernels.py --threads 1 2 --active 0.05 0.1 0.25 --simd avx2
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import optiml
from optiml import _core, quant


def best_seconds(fn, n_calls: int, repeats: int) -> float:
    """Best of `repeats` passes (mean seconds of one of n_calls calls fn(i)): the best pass, not the
    median, because shared build machines make the slow passes measure other people's work."""
    for i in range(n_calls):  # warm up: pool threads, page faults
        fn(i)
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n_calls):
            fn(i)
        passes.append((time.perf_counter() - t0) / n_calls)
    return min(passes)


def copies_of(a: np.ndarray, span_mib: int) -> list:
    n = max(1, -(-(span_mib << 20) // a.nbytes))
    return [a] + [a.copy() for _ in range(n - 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-embd", type=int, default=4096)
    ap.add_argument("--n-ff", type=int, default=11008)
    ap.add_argument("--active", nargs="*", type=float, default=[0.1], help="fractions of active neurons")
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--nm-types", nargs="*", default=["q8_0", "f16"], help="neuron-major row types")
    ap.add_argument("--gate-type", default="q4_0")
    ap.add_argument("--layers", type=int, default=32, help="layers, to extrapolate the repack time")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--span", type=int, default=256, help="MiB of weight copies cycled through (default 256)")
    ap.add_argument("--simd", default="", help="scalar, avx2, avx512 or neon (default: the best available)")
    args = ap.parse_args()

    info = optiml.system_info()
    simd = args.simd or info["simd"]
    print(f"# simd={simd} physical_cores={info['physical_cores']} n_embd={args.n_embd} n_ff={args.n_ff}")
    bandwidth = {n: _core.measure_read_bandwidth(1 << 30, 5, n) for n in args.threads}
    for n, bw in bandwidth.items():
        print(f"# memory read bandwidth, {n} thread(s): {bw / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    wf = rng.standard_normal((args.n_ff, args.n_embd), dtype=np.float32) * 0.02

    def row(name: str, n_bytes: int, times: dict) -> str:
        line = f"{name:<34}"
        for n in args.threads:
            gbs = n_bytes / times[n] / 1e9
            line += f" | {times[n] * 1e3:7.3f} {gbs:5.1f} {gbs * 1e9 / bandwidth[n]:5.0%}"
        return line

    header = f"{'kernel':<34}" + "".join(f" | {n}t ms    GB/s of-bw" for n in args.threads)
    print(header)
    print("-" * len(header))
    for nm_type in args.nm_types:
        t = quant.type_id(nm_type)
        nm = quant.quantize(wf, nm_type)  # [n_ff, n_embd]: neuron-major rows as repack makes them
        copies = copies_of(nm, args.span)
        for frac in args.active:
            k = max(1, int(round(frac * args.n_ff)))
            idx = [np.sort(rng.choice(args.n_ff, size=k, replace=False)).astype(np.int32) for _ in copies]
            a = rng.standard_normal(k).astype(np.float32)
            times = {n: best_seconds(lambda i: _core.axpy_rows(copies[i], t, args.n_ff, args.n_embd, idx[i], a,
                                                                 n_threads=n, simd=simd), len(copies), args.repeats)
                     for n in args.threads}
            print(row(f"axpy_rows {nm_type} k={k}", k * nm.shape[1], times), flush=True)
        del copies

    # The engine's copy of a down matrix of --gate-type: grouped (lossless 4-bit, one scale per 32-neuron
    # group read once per touched group) against 8-bit rows, same matrix, same neurons.
    down_t = quant.type_id(args.gate_type)
    down = quant.quantize(np.ascontiguousarray(wf.T), args.gate_type)  # [n_embd, n_ff]
    copies = {g: [_core.NeuronMajor(down, down_t, args.n_embd, args.n_ff, grouped=g)
                  for _ in range(max(1, args.span // 64))] for g in (False, True)}
    if copies[True][0].grouped:
        for frac in args.active:
            k = max(1, int(round(frac * args.n_ff)))
            n_copies = len(copies[True])
            idx = [np.sort(rng.choice(args.n_ff, size=k, replace=False)).astype(np.int32) for _ in range(n_copies)]
            a = rng.standard_normal(k).astype(np.float32)
            times = {}
            for g in (False, True):
                times[g] = {n: best_seconds(lambda i: copies[g][i].axpy(idx[i], a, n_threads=n, simd=simd), n_copies,
                                            args.repeats) for n in args.threads}
            for g in (False, True):
                name = f"down copy {'grouped' if g else '8-bit'} {args.gate_type} k={k}"
                line = row(name, copies[g][0].nbytes * k // args.n_ff, times[g])
                if g:
                    line += "  grouped/8-bit time: " + " ".join(
                        f"{n}t {times[True][n] / times[False][n]:.2f}x" for n in args.threads)
                print(line, flush=True)
    del copies

    gt = quant.type_id(args.gate_type)
    gate = quant.quantize(wf, args.gate_type)  # [n_ff, n_embd]
    copies = copies_of(gate, args.span)
    x = rng.standard_normal((1, args.n_embd)).astype(np.float32)
    for frac in args.active:
        k = max(1, int(round(frac * args.n_ff)))
        idx = [np.sort(rng.choice(args.n_ff, size=k, replace=False)).astype(np.int32) for _ in copies]
        times = {n: best_seconds(lambda i: _core.matmul_rows(copies[i], gt, args.n_ff, args.n_embd, idx[i], x,
                                                               n_threads=n, simd=simd), len(copies), args.repeats)
                 for n in args.threads}
        print(row(f"matmul_rows {args.gate_type} k={k}", k * gate.shape[1], times), flush=True)
    del copies

    # down is [n_embd, n_ff]; repack to Q8_0 neuron-major rows.
    down = quant.quantize(np.ascontiguousarray(wf.T), args.gate_type)
    for n in args.threads:
        t0 = time.perf_counter()
        _core.repack_neuron_major(down, gt, args.n_embd, args.n_ff, quant.type_id("q8_0"), n_threads=n)
        s = time.perf_counter() - t0
        print(f"repack_neuron_major {args.gate_type}->q8_0, {n}t: {s:.3f} s per layer, "
              f"{s * args.layers:.1f} s for {args.layers} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
