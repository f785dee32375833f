"""optiml calibrate: per-layer sparsity thresholds for a target share of skipped neurons, written into a copy
of the model (optiml.offline.calibrate)."""

from __future__ import annotations

from .._core import ArgumentError
from ..formats import stats
from ..offline.calibrate import calibrate
from . import common


def add_arguments(p) -> None:
    common.add_data_args(p, "to calibrate on", required=False)
    p.add_argument("--stats", default=None, help="stats from optiml profile on this model, instead of --data")
    p.add_argument("--target", type=float, default=0.5, help="share of FFN neurons to skip (default 0.5)")
    p.add_argument("--criterion", choices=("product", "weighted", "gate"), default="product",
                   help="skip by |act(gate)*up| (product: best quality, up computed densely), by |act(gate)| times "
                        "the neuron's mean |up| and down-column norm (weighted: also skips up rows; two profiling "
                        "passes), or by |act(gate)| (gate). Default product")
    p.add_argument("--allocation", choices=("uniform", "greedy"), default="uniform",
                   help="every layer the target (uniform), or spread to minimize estimated error (greedy)")
    p.add_argument("--tokens", type=int, default=None, help="calibration tokens of --data (default 8192)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (512)")
    p.add_argument("-t", "--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", required=True, help="the model copy to write, with the thresholds")


def run(args) -> int:
    if args.stats is not None and (args.data or args.tokens is not None):
        raise ArgumentError("--stats holds its calibration tokens already: give --stats, or --data (and --tokens), "
                            "not both")
    common.check_output(args.output, [args.stats, *(args.data or [])])  # (before a known model name is pulled)
    model = common.model_arg(args.model)
    common.check_output(args.output, [model])
    cal = calibrate(model, args.data, target=args.target, out=args.output, n_tokens=8192 if args.tokens is None else args.tokens,
                    criterion=args.criterion, allocation=args.allocation, n_ctx=args.ctx,
                    n_threads=args.threads, progress=not args.quiet, field=args.field,
                    stats=None if args.stats is None else stats.load(args.stats))
    print(f"criterion {cal.criterion}, allocation {cal.allocation}, target {cal.target:.0%} of FFN neurons skipped "
          f"(on {cal.n_tokens} calibration tokens)")
    print("layer  skip   threshold")
    for l, (t, sh) in enumerate(zip(cal.threshold, cal.layer_target)):
        print(f"{l:5d}  {sh:5.1%}  {t:.5g}")
    print(f"wrote {args.output}")
    return 0
