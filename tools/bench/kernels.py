#!/usr/bin/env python3
"""Matrix-vector throughput per weight format, against this machine's measured read bandwidth, or
with --tokens N > 1 the batched product (prompt processing) in GFLOP/s.

For each format and shape, a random weight matrix is quantized once and copied until the copies span
--span MiB (far beyond the last-level cache), then y = W x is timed over the copies in turn (median of
--repeats passes), so every product streams its weights from memory as decoding a real model does.
Throughput is weight bytes read per second; the fraction is that throughput over the memory read
bandwidth measured in the same run with the same thread count. With --tokens N, x holds N tokens and
the product is compute-bound: the table gives 2 * rows * cols * N / time instead.

    python tools/bench/kernels.py                       # all formats, 4096x4096 and 4096x11008, 1 and 2 threads
    python tools/bench/kernels.py --types q4_0 q4_k --threads 1 2 4 --simd avx2
    python tools/bench/kernels.py --tokens 128 --span 64 --types q4_1 q5_0 q4_k q6_k
"""

from __future__ import annotations

import argparse

import numpy as np

import harness
import optiml
from optiml import _core
from optiml import quant

FORMATS = ["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0",
           "q6_k", "q5_k", "q4_k", "q3_k", "q2_k"]
SHAPES = [(4096, 4096), (4096, 11008)]


def time_matvec(copies: list, qtype: str, x: np.ndarray, simd: str, n_threads: int, repeats: int,
                rows16: bool = False) -> float:
    """Median seconds of one matrix-vector product, cycling through copies so none stays cached."""
    return harness.per_call(lambda i: quant.matmul(copies[i], qtype, x, n_threads=n_threads, simd=simd, rows16=rows16),
                            len(copies), repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", default=FORMATS)
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--span", type=int, default=512, help="MiB of weight copies cycled through (default 512)")
    ap.add_argument("--simd", default="", help="scalar, avx2, avx512 or neon (default: the best available)")
    ap.add_argument("--shapes", nargs="*", default=[f"{r}x{c}" for r, c in SHAPES],
                    help="ROWSxCOLS (default: 4096x4096 4096x11008; Gemma 3 270M's output layer is 262144x640)")
    ap.add_argument("--tokens", type=int, default=1, help="activation rows per product (default 1: matrix-vector)")
    ap.add_argument("--rows16", action="store_true",
                    help="also time the rows16 layout (Q4_0/Q4_1/Q8_0, AVX-512VNNI) and print rows16 / rows")
    args, res = harness.parse(ap, "kernels")

    simd, bandwidth = harness.kernel_context(args.simd, args.threads, compiler=optiml.system_info()["compiler"])

    rng = np.random.default_rng(0)
    batch = args.tokens > 1
    header = f"{'format':<6} {'shape':>11}" + "".join(
        (f" | {n}t ms  GFLOP/s" if batch else f" | {n}t ms  GB/s  of-bw") for n in args.threads)
    print(header)
    print("-" * len(header))
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    except ValueError:
        ap.error(f"--shapes takes ROWSxCOLS, e.g. 4096x11008; got {args.shapes}")
    for rows, cols in shapes:
        wf = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        x = rng.standard_normal((args.tokens, cols), dtype=np.float32)
        for qtype in args.types:
            if cols % quant.type_info(qtype).block_size:
                continue  # the row is not whole blocks of this format (640 columns and k-quants)
            w = quant.quantize(wf, qtype)
            copies = harness.copies_of(w, args.span)
            layouts = [False]
            if args.rows16 and qtype in ("q4_0", "q4_1", "q8_0") and rows % 16 == 0 and _core.has_rows16(simd):
                layouts.append(True)
                copies16 = [quant.rows16(c, qtype, cols) for c in copies]
            for rows16 in layouts:
                line = f"{qtype + ('/r16' if rows16 else ''):<8} {rows:>5}x{cols:<5}"
                for n in args.threads:
                    # rows is timed again right after rows16, so the ratio compares two close-in-time runs
                    # on a shared machine whose speed drifts.
                    s = time_matvec(copies16 if rows16 else copies, qtype, x, simd, n, args.repeats, rows16)
                    if rows16:
                        s0 = time_matvec(copies, qtype, x, simd, n, args.repeats)
                    row = res.add(format=qtype, layout="rows16" if rows16 else "rows", shape=f"{rows}x{cols}",
                                  tokens=args.tokens, threads=n, ms=s * 1e3)
                    if batch:
                        row["gflops"] = 2 * rows * cols * args.tokens / s / 1e9
                        line += f" | {s * 1e3:6.2f} {row['gflops']:8.1f}"
                    else:
                        gbs = w.nbytes / s / 1e9
                        row.update(gb_s=gbs, of_read_bandwidth=gbs * 1e9 / bandwidth[n])
                        line += f" | {s * 1e3:6.2f} {gbs:5.1f} {gbs * 1e9 / bandwidth[n]:6.0%}"
                    if rows16:
                        row["vs_rows"] = s0 / s
                        line += f" ({s0 / s:.2f}x rows)"
                print(line, flush=True)
            del copies
            copies16 = None
    res.note(f"read bandwidth GB/s by threads: { {n: round(b / 1e9, 1) for n, b in bandwidth.items()} }")
    res.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
