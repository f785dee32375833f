#!/usr/bin/env python3
"""The CUDA backend's product kernels alone: achieved bandwidth at decode and TFLOP/s for a prompt, per weight
type and 7B/13B matrix shape, beside the device's measured copy bandwidth (issue #43's kernel benchmark).

    python tools/bench/gpu_kernels.py [--types q4_0 q4_k ...] [--shapes 7b 13b] [--prompt 512] [--span 1024]

For every type and shape: one token (the decode kernels built for one token: GB/s of weights read, and that
over the copy bandwidth; a copy reads and writes, so a product that only reads can exceed 100%; and the
kernels built for batches at one token, as decode ran before the one-token kernels), 8 tokens (one pass of the
decode kernels over the weights for all of them: effective GB/s) and a prompt of --prompt tokens (TFLOP/s,
2 * rows * cols * tokens per launch: the tensor-core tiles for every type but F32 and MXFP4, and the decode
kernels, 8 tokens a pass, for every type as the baseline the tiles replace). "exact 1 token": the kernels of a
split's device share, which sum in the CPU's order (matmul_exact.cu), at one token. The weights are random values
quantized on the host and copied until the copies span --span MiB, well past the GPU's L2 cache, so each
launch streams its weights from memory (native/src/cuda/product_timing.cu). Needs a CUDA build and device;
on the emulator build it runs too (slowly: use --shapes tiny).
"""

from __future__ import annotations

import argparse
import sys

import harness
import optiml
from optiml import _core, quant

TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "f16", "bf16"]
SHAPES = {  # rows x cols of the products of one layer: q/k/v/o, gate/up, down
    "7b": [(4096, 4096), (11008, 4096), (4096, 11008)],
    "13b": [(5120, 5120), (13824, 5120), (5120, 13824)],
    "tiny": [(128, 256)],
}
TILE_TYPES = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs",
              "f16", "bf16"}
EXACT_TYPES = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", default=TYPES)
    ap.add_argument("--shapes", nargs="*", default=["7b", "13b"], choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=512, help="tokens of the prompt products (default 512)")
    ap.add_argument("--reps", type=int, default=20, help="launches timed per product (default 20)")
    ap.add_argument("--span", type=int, default=1024, help="MiB of weight copies cycled through (default 1024)")
    ap.add_argument("--device", type=int, default=0)
    args, res = harness.parse(ap, "gpu_kernels")
    devices = optiml.system_info()["cuda_devices"]
    if not devices:
        print("no CUDA device (and not the emulator build): nothing to measure", file=sys.stderr)
        return 1
    name = devices[args.device]["name"]
    copy = _core._cuda_copy_bandwidth(args.device, 1 << 30 if "emulator" not in name else 1 << 20, 10)
    print(f"{name}: device-to-device copy {copy / 1e9:.0f} GB/s (read + written)")
    span = args.span << 20
    print("| type | rows x cols | 1 token GB/s | of copy | 1 token, batch kernels GB/s | 8 tokens GB/s | "
          "prompt TFLOP/s (tiles) | prompt TFLOP/s (decode kernels) | tiles faster | exact 1 token GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qtype in args.types:
        info = quant.type_info(qtype)
        for shape in args.shapes:
            for rows, cols in SHAPES[shape]:
                if cols % info.block_size:
                    continue

                def timed(n, kernel, reps=args.reps):
                    return _core._cuda_time_product(args.device, info.id, rows, cols, n, kernel, reps, span)

                one = timed(1, "decode")
                one_batch = timed(1, "decode-batch")
                eight = timed(8, "decode")
                flop = 2.0 * rows * cols * args.prompt
                base = timed(args.prompt, "decode", max(2, args.reps // 4))
                tiles = timed(args.prompt, "tiles", max(2, args.reps // 4)) if qtype in TILE_TYPES else None
                exact = timed(1, "exact") if qtype in EXACT_TYPES else None
                row = res.add(type=qtype, rows=rows, cols=cols, kernel_1=one["kernel"],
                              gbs_1=one["weight_bytes"] / one["seconds"] / 1e9,
                              of_copy=one["weight_bytes"] / one["seconds"] / copy,
                              gbs_1_batch_kernels=one_batch["weight_bytes"] / one_batch["seconds"] / 1e9,
                              gbs_8=eight["weight_bytes"] / eight["seconds"] / 1e9,
                              tflops_tiles=flop / tiles["seconds"] / 1e12 if tiles else None,
                              tflops_decode_kernels=flop / base["seconds"] / 1e12,
                              tiles_speedup=base["seconds"] / tiles["seconds"] if tiles else None,
                              gbs_exact_1=exact["weight_bytes"] / exact["seconds"] / 1e9 if exact else None)
                t = f"{row['tflops_tiles']:.1f}" if tiles else "-"
                x = f"{row['tiles_speedup']:.1f}x" if tiles else "-"
                e = f"{row['gbs_exact_1']:.0f}" if exact else "-"
                print(f"| {qtype} | {rows}x{cols} | {row['gbs_1']:.0f} | {row['of_copy']:.0%} | "
                      f"{row['gbs_1_batch_kernels']:.0f} | {row['gbs_8']:.0f} | "
                      f"{t} | {row['tflops_decode_kernels']:.2f} | {x} | {e} |", flush=True)
    res.note(f"device {name}; copy bandwidth {copy / 1e9:.0f} GB/s; span {args.span} MiB; prompt {args.prompt}")
    res.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
