"""optiml hw: measure this machine for optiml solve (CPU product rates per weight type; with --device a GPU's
bandwidth, copy latency and sync cost)."""

from __future__ import annotations

import sys

from .. import _core
from ..offline.hardware import Hardware
from ..util.sizes import parse_size
from . import common


def add_arguments(p) -> None:
    p.add_argument("--device", default=None,
                   help="cuda[:N]: measure that GPU too (cpu:1: the same path on a second CPU device, for testing)")
    p.add_argument("--types", nargs="+", default=["q4_0", "q4_1", "q4_k", "q8_0"], help="weight types to time")
    p.add_argument("--size", default="256MiB", help="weights per timed product (beyond the caches; default 256MiB)")
    p.add_argument("-t", "--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("-o", "--output", help="write the profile as JSON (for optiml solve --hardware FILE)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def run(args) -> int:
    if args.output:
        common.check_output(args.output, [])  # (before a minute of timings)
    say = None if args.quiet or args.json else (lambda msg: print(f"measuring {msg} ...", file=sys.stderr, flush=True))
    hw = Hardware.measure(device=args.device, types=args.types, weight_bytes=parse_size(args.size),
                          n_threads=args.threads or 0, progress=say)
    if args.output:
        hw.save(args.output)
    if args.json:
        common.print_json(hw.to_dict())
        return 0
    print(f"CPU ({args.threads or _core.get_num_threads()} threads): read bandwidth {hw.cpu_bandwidth / 1e9:.1f} GB/s")
    print(f"  {'type':8} {'dense GB/s':>10} {'sparse rows GB/s':>16}")
    for t in hw.cpu_dense:
        print(f"  {t:8} {hw.cpu_dense[t] / 1e9:10.1f} {hw.cpu_sparse[t] / 1e9:16.1f}")
    print(f"  sparse down projection (8-bit neuron-major rows): {hw.cpu_sparse_down / 1e9:.1f} GB/s")
    if args.device:
        print(f"device {args.device}: memory traffic {hw.gpu_bandwidth / 1e9:.1f} GB/s, copies "
              f"{hw.transfer_bandwidth / 1e9:.1f} GB/s (pageable host memory), small copy and wait "
              f"{hw.transfer_latency * 1e6:.1f} us, event round trip {hw.sync_cost * 1e6:.1f} us, per op "
              f"{hw.op_cost * 1e6:.2f} us")
    if args.output:
        print(f"wrote {args.output} (optiml solve --hardware {args.output})")
    return 0
