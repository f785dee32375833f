#!/usr/bin/env python3
"""Throughput of the sparse FFN kernels (native/src/cpu/sparse*.cpp) on a 7B-shaped layer.

  * axpy_rows (column-sparse down): --active of the n_ff neuron-major rows, each dim values of
    F32/F16/Q8_0, accumulated into y; throughput is the neuron-row bytes read per second;
  * matmul_rows (row-sparse gate/up): the same fraction of the n_ff rows of a --gate-type matrix, and
    below it the same pattern only read (no arithmetic: what the memory system gives that pattern);
  * the engine's down copies of a --gate-type matrix, compact (grouped: lossless, Q4_0/Q4_1/Q4_K, integer
    sums) against fast (8-bit rows): time per call for the same neurons, bytes read per second (rows, and
    the compact copy's scales of the touched groups), and the compact/fast time ratio, tabled at the end;
  * repack_neuron_major: seconds to repack one down matrix, and that times --layers.

Copies of the weights spanning --span MiB are cycled through, so rows come from memory, not cache,
as in decoding a real model. The fraction is throughput over the memory read bandwidth measured in
the same run with the same thread count.

    python tools/bench/sparse_kernels.py
    python tools/bench/sparse_kernels.py --threads 1 2 --active 0.05 0.1 0.25 --simd avx2
    python tools/bench/sparse_kernels.py --parts down --active 0.01 0.05 0.1 0.5   # compact vs fast
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import harness
from optiml import _core, quant


def best_seconds(fn, n_calls: int, repeats: int) -> float:
    """The best pass, not the median: shared build machines make the slow passes measure other people's
    work."""
    return harness.per_call(fn, n_calls, repeats, pick=min)


PARTS = ("axpy", "down", "matmul", "repack")


def down_copies(args, down, down_t, rng, simd, row) -> dict:
    """Times the compact (grouped) and fast (8-bit) copies of `down` on the same neurons; prints a row per
    copy and fraction, returns {fraction: {threads: compact time / fast time}}. Enough copies of each to
    span --span MiB, and a fresh neuron list per call, cycled over enough calls that one cycle touches
    about --span MiB: the rows then come from memory, not from the last-level cache."""
    made = {}
    for compact in (False, True):
        first = _core.NeuronMajor(down, down_t, args.n_embd, args.n_ff, grouped=compact)
        if compact and not first.grouped:
            print(f"# no compact copy of {args.gate_type}: nothing to compare")
            return {}
        n = max(2, -(-(args.span << 20) // first.nbytes))
        made[compact] = [first] + [_core.NeuronMajor(down, down_t, args.n_embd, args.n_ff, grouped=compact)
                                   for _ in range(n - 1)]
    fast_row = made[False][0].nbytes / args.n_ff
    scale_bytes = (4 if args.gate_type == "q4_k" else 2) * (1 if args.gate_type == "q4_0" else 2)
    ratios = {}
    for frac in args.active:
        k = max(1, int(round(frac * args.n_ff)))
        n_calls = min(512, max(len(made[True]), -(-(args.span << 20) // int(k * fast_row))))
        idx = [np.sort(rng.choice(args.n_ff, size=k, replace=False)).astype(np.int32) for _ in range(n_calls)]
        a = rng.standard_normal(k).astype(np.float32)
        # Bytes read per call: the rows, and for the compact copy each touched group's scales (and minimums).
        groups = np.mean([len(np.unique(i // 32)) for i in idx])
        touched = {False: k * fast_row, True: k * args.n_embd / 2 + groups * args.n_embd * scale_bytes}
        times = {}
        for compact in (False, True):
            cs = made[compact]
            times[compact] = {n: best_seconds(lambda i: cs[i % len(cs)].axpy(idx[i], a, n_threads=n, simd=simd),
                                              n_calls, args.repeats) for n in args.threads}
        ratios[frac] = {n: times[True][n] / times[False][n] for n in args.threads}
        for compact in (False, True):
            name = f"down {'compact' if compact else 'fast'} {args.gate_type} k={k}"
            line = row(name, int(touched[compact]), times[compact])
            if compact:
                line += "  compact/fast: " + " ".join(f"{n}t {ratios[frac][n]:.2f}x" for n in args.threads)
            print(line, flush=True)
    return ratios


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
    ap.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS,
                    help="what to time: axpy (F32/F16/Q8_0 rows), down (the engine's compact and fast down "
                         "copies), matmul (matmul_rows), repack (default: all)")
    args, res = harness.parse(ap, "sparse_kernels")

    simd, bandwidth = harness.kernel_context(args.simd, args.threads, n_embd=args.n_embd, n_ff=args.n_ff)
    rng = np.random.default_rng(0)
    wf = rng.standard_normal((args.n_ff, args.n_embd), dtype=np.float32) * 0.02

    def row(name: str, n_bytes: int, times: dict) -> str:
        line = f"{name:<34}"
        for n in args.threads:
            gbs = n_bytes / times[n] / 1e9
            res.add(kernel=name.strip(), threads=n, ms=times[n] * 1e3, gb_s=gbs, of_read_bandwidth=gbs * 1e9 / bandwidth[n])
            line += f" | {times[n] * 1e3:7.3f} {gbs:5.1f} {gbs * 1e9 / bandwidth[n]:5.0%}"
        return line

    header = f"{'kernel':<34}" + "".join(f" | {n}t ms    GB/s of-bw" for n in args.threads)
    print(header)
    print("-" * len(header))
    for nm_type in args.nm_types if "axpy" in args.parts else []:
        t = quant.type_id(nm_type)
        nm = quant.quantize(wf, nm_type)  # [n_ff, n_embd]: neuron-major rows as repack makes them
        copies = harness.copies_of(nm, args.span)
        for frac in args.active:
            k = max(1, int(round(frac * args.n_ff)))
            idx = [np.sort(rng.choice(args.n_ff, size=k, replace=False)).astype(np.int32) for _ in copies]
            a = rng.standard_normal(k).astype(np.float32)
            times = {n: best_seconds(lambda i: _core.axpy_rows(copies[i], t, args.n_ff, args.n_embd, idx[i], a,
                                                                 n_threads=n, simd=simd), len(copies), args.repeats)
                     for n in args.threads}
            print(row(f"axpy_rows {nm_type} k={k}", k * nm.shape[1], times), flush=True)
        del copies

    # The engine's two copies of a down matrix of --gate-type: "compact" (grouped: lossless 4-bit, a group's
    # scales read once per touched group, integer sums) against "fast" (8-bit rows), same neurons.
    if "down" in args.parts:
        down_t = quant.type_id(args.gate_type)
        down = quant.quantize(np.ascontiguousarray(wf.T), args.gate_type)  # [n_embd, n_ff]
        ratios = down_copies(args, down, down_t, rng, simd, row)
        if ratios:
            print("\ncompact/fast time (below 1: compact faster)")
            print(f"{'active':>8}" + "".join(f" | {n}t   " for n in args.threads))
            for frac, by_n in ratios.items():
                print(f"{frac:>8.0%}" + "".join(f" | {by_n[n]:.2f}x" for n in args.threads))
            print()

    gt = quant.type_id(args.gate_type)
    gate = quant.quantize(wf, args.gate_type)  # [n_ff, n_embd]
    copies = harness.copies_of(gate, args.span) if "matmul" in args.parts else []
    x = rng.standard_normal((1, args.n_embd)).astype(np.float32)
    for frac in args.active if "matmul" in args.parts else []:
        k = max(1, int(round(frac * args.n_ff)))
        idx = [np.sort(rng.choice(args.n_ff, size=k, replace=False)).astype(np.int32) for _ in copies]
        times = {n: best_seconds(lambda i: _core.matmul_rows(copies[i], gt, args.n_ff, args.n_embd, idx[i], x,
                                                               n_threads=n, simd=simd), len(copies), args.repeats)
                 for n in args.threads}
        print(row(f"matmul_rows {args.gate_type} k={k}", k * gate.shape[1], times), flush=True)
        # The same pattern read and nothing computed: what the memory system gives it (one long pass, so
        # not a strict bound on the kernel's short calls).
        if gate.shape[1] % 64 == 0:
            reads = {n: k * gate.shape[1] / _core.measure_scattered_read_bandwidth(gate.shape[1], frac, 1 << 30, 3, n)
                     for n in args.threads}
            print(row(f"  read only, {frac:.0%} of rows", k * gate.shape[1], reads), flush=True)
    del copies

    # down is [n_embd, n_ff]; repack to Q8_0 neuron-major rows.
    down = quant.quantize(np.ascontiguousarray(wf.T), args.gate_type)
    for n in args.threads if "repack" in args.parts else []:
        t0 = time.perf_counter()
        _core.repack_neuron_major(down, gt, args.n_embd, args.n_ff, quant.type_id("q8_0"), n_threads=n)
        s = time.perf_counter() - t0
        print(f"repack_neuron_major {args.gate_type}->q8_0, {n}t: {s:.3f} s per layer, "
              f"{s * args.layers:.1f} s for {args.layers} layers")
    res.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
