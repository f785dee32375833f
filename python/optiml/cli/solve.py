"""optiml solve: which FFN neurons go to the GPU (optiml.offline.solve), or for a mixture of experts which
experts (optiml.offline.solve_experts), written into a placed copy of the model (optiml.formats.placement)."""

from __future__ import annotations

import os
import shutil
import sys
import warnings

from .._core import ArgumentError
from ..formats import stats
from ..engine.sparsity import beside
from ..formats.placement import check_placeable, write_expert_placement, write_placed
from ..formats.predictors import default_predictor_path
from ..offline.hardware import Hardware
from ..offline.solve import format_report, solve_placement
from ..offline.coactive import check_stats, placed_order
from ..offline.solve_experts import solve_expert_placement
from ..util.atomic import atomic_output
from ..util.sizes import parse_size
from . import common


def add_arguments(p) -> None:
    p.add_argument("-m", "--model", required=True, help=common.MODEL_HELP)
    p.add_argument("--stats", required=True, help="activation statistics (.npz from optiml profile)")
    p.add_argument("--vram", required=True,
                   help="GPU memory budget: bytes or a size with a unit (6GiB, 512MiB, 6GB)")
    p.add_argument("--hardware", "--hw", default="auto",
                   help="auto (measure the CPU bandwidth, defaults for the rest) or a JSON file from optiml hw -o")
    p.add_argument("--ctx", type=int, default=4096, help="context length whose KV cache is placed (default 4096)")
    p.add_argument("--group", type=int, default=64,
                   help="neurons per group (rounded up to the quant block size; default 64)")
    p.add_argument("--batch", type=int, default=512,
                   help="most tokens per step the model will run with (its n_batch), for the device's scratch")
    p.add_argument("--positions", type=int, default=None,
                   help="past tokens a decode step attends to, for the time to read the KV cache (default: half of "
                        "--ctx, the mean over a context filled from empty)")
    p.add_argument("--predictors", default="auto",
                   help="the predictor file the model will run with (optiml train-predictors): the CPU's FFN share "
                        "is timed as it reads with them (neurons predicted active, not every gate row), and they are "
                        "copied beside the placed file, where a Model finds them. auto (the default): "
                        "MODEL.predictors.gguf beside the model when a Model would use it; none: without")
    p.add_argument("--time-limit", type=float, default=30.0,
                   help="HiGHS time limit in seconds, for all its programs together (a budget below the fixed part "
                        "solves up to four); default 30")
    p.add_argument("--order", choices=("hot", "coactive"), default="hot",
                   help="the CPU's neurons in each layer: hot (most frequent first, the default) or coactive "
                        "(neurons that fire together side by side, so a sparse step reads longer runs of rows: "
                        "needs stats profiled with --samples N). --vram 0 orders for the CPU alone")
    p.add_argument("-o", "--outfile", required=True, help="GGUF file to write (neurons permuted, placement recorded)")


def run(args) -> int:
    hardware = None if args.hardware == "auto" else args.hardware
    predictors = None if args.predictors in ("auto", "none") else args.predictors
    common.check_output(args.outfile, [args.stats, hardware, predictors])  # before a known model name is pulled
    model = common.model_arg(args.model)
    common.check_output(args.outfile, [model])
    vram = parse_size(args.vram)
    if args.ctx < 1:
        raise ArgumentError(f"--ctx must be >= 1, not {args.ctx}")
    if args.batch < 1:
        raise ArgumentError(f"--batch must be >= 1, not {args.batch}")
    if args.group < 1:
        raise ArgumentError(f"--group must be >= 1, not {args.group}")
    if args.positions is not None and args.positions < 0:
        raise ArgumentError(f"--positions must be >= 0, not {args.positions}")
    if not args.time_limit > 0:
        raise ArgumentError(f"--time-limit must be > 0, not {args.time_limit}")
    st = stats.load(args.stats)
    st.check_model(model)  # (before anything that reads the stats' activation or shape)
    if not st.is_moe:
        check_placeable(model)
    if args.positions is not None and args.positions > args.ctx:
        raise ArgumentError(f"--positions {args.positions} is more than --ctx {args.ctx}")
    if args.order == "coactive":  # before the solver's work
        check_stats(st, args.stats, warn=False)  # (placed_order warns about few samples)
    hw = Hardware.auto() if args.hardware == "auto" else Hardware.from_json(args.hardware)
    if st.is_moe and args.predictors not in ("auto", "none"):
        raise ArgumentError("--predictors: this model's layers are mixtures of experts, placed by whole experts, "
                            "which read every row they hold: leave --predictors out")
    pred = None if st.is_moe else _predictors(args.predictors, model, st.activation)
    with warnings.catch_warnings():
        if vram == 0:  # (the CPU-only mode: that nothing fits on a device is what was asked for)
            warnings.filterwarnings("ignore", message="the budget of 0 bytes")
        if st.is_moe:  # whole experts (optiml.offline.solve_experts)
            placement = solve_expert_placement(model, st, vram, hw, ctx=args.ctx, time_limit=args.time_limit,
                                               batch=args.batch, positions=args.positions)
        else:
            placement = solve_placement(model, st, vram, hw, ctx=args.ctx, group=args.group,
                                        time_limit=args.time_limit, batch=args.batch, positions=args.positions,
                                        predictors=pred)
    print(format_report(placement))
    if st.is_moe:
        write_expert_placement(model, st, placement, args.outfile, progress=not args.quiet)
        print(f"wrote {args.outfile}: weights unchanged, each layer's GPU experts in optiml.placement.gpu_experts")
        _remove_old_predictors(args.outfile, [model, args.stats, hardware])
        return 0
    order = None
    if args.order == "coactive":
        order, runs = placed_order(st, placement.gpu_neurons)
        before = sum(r[0] for r in runs) / len(runs)
        after = sum(r[1] for r in runs) / len(runs)
        print(f"co-activation order: a step's active CPU rows come in runs of {before:.2f} rows hot-first, "
              f"{after:.2f} in this order (mean over layers, on sampled tokens held out from the ordering)")
    res = write_placed(model, st, placement, args.outfile, order=order, order_name="coactive", progress=not args.quiet)
    if res["form"] == "permuted":
        how = f"FFN neurons permuted {'hot-first' if order is None else 'in the co-activation order'} in the file"
    else:
        how = ("weights kept in their order (quantized down tensors cannot move a neuron's column exactly), "
               "placed order in optiml.placement.neuron_order")
    print(f"wrote {args.outfile}: {how}")
    if pred and res["form"] != "permuted":
        _predictors_beside_output(pred, args.outfile)
    else:
        if pred:
            print(f"optiml solve: warning: the placed file permutes its neurons, so {os.path.basename(pred)} does "
                  f"not fit it: train predictors for it (optiml train-predictors -m {args.outfile})", file=sys.stderr)
        _remove_old_predictors(args.outfile, [model, args.stats, hardware, pred])
    return 0


def _predictors(choice: str, model: str, activation: str) -> str | None:
    """The predictor file to time the CPU's share with: --predictors' choice."""
    if choice == "none":
        return None
    if choice != "auto":
        return choice
    d = beside(model, activation)
    if d["used"]:
        common.log(f"predictors: {d['path']} (beside the model; --predictors none to place without them)")
        return d["path"]
    if d["found"]:
        common.log(f"predictors: not using {d['path']}: {d['why']}")
    return None


def _predictors_beside_output(pred: str, out: str) -> None:
    """The predictors the placement was timed with, beside the placed file where a Model looks for them (for a
    file that keeps its neurons' order: one that permutes them needs its own)."""
    dest = default_predictor_path(out)
    if os.path.abspath(dest) != os.path.abspath(pred):
        with atomic_output(dest, ".gguf") as tmp:  # (never half a file where a Model would take it up)
            shutil.copyfile(pred, tmp)
    print(f"predictors: {dest} beside it (a Model of the placed file uses them by itself)")


def _remove_old_predictors(out: str, inputs: list) -> None:
    """Removes OUT.predictors.gguf that the new placed file did not come with (it is in place by now): it
    belongs to what was at OUT before, and a Model of the new file would take it up by itself. An input of
    this run is never removed (None: an input not given)."""
    dest = default_predictor_path(out)
    if not os.path.isfile(dest) or any(i is not None and os.path.exists(i) and os.path.samefile(dest, i)
                                       for i in inputs):
        return
    os.remove(dest)
    common.log(f"predictors: removed {dest}: it was beside the file this one replaces, and a Model of the new file "
               "would take it up by itself (this placement comes without predictors)")
