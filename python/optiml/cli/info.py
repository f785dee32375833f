"""optiml info: a GGUF file's header, metadata, tensors and placement; with --plan where each layer would run,
with --plot the figure of its activation curves, with --json all of it as one object."""

from __future__ import annotations

import json
import os

import numpy as np

from .. import _core
from .._core import ArgumentError, OptimlError
from ..engine import plan
from ..engine.companions import companions
from ..formats import gguf, stats
from ..formats.placement import coverage_curve, curve_ranks, ffn_layout, layer_bytes, read_placement
from ..offline import coverage
from ..offline.coverage import plot
from ..offline.solve import attention_line
from ..util.sizes import mib
from . import common


def add_arguments(p) -> None:
    p.add_argument("model", help=common.MODEL_HELP)
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw the activation power law and the coverage curve (pip install optiml[plot])")
    p.add_argument("--stats", metavar="STATS.npz", default=None,
                   help="activation statistics (optiml profile) to plot, e.g. for a model without a placement")
    p.add_argument("--plan", action="store_true",
                   help="print the execution plan instead: where each layer's attention and FFN neurons run")
    common.add_device_args(p, loads_weights=False)
    p.add_argument("--ctx", type=int, default=None, help="context length per sequence for --plan (default: the "
                   "model's, at most 4096)")
    p.add_argument("--parallel", type=int, default=1, help="sequence slots for --plan")
    p.add_argument("--kv-vram", default=None, help="device memory for the KV cache, for --plan (see optiml serve)")
    p.add_argument("--json", action="store_true", help="print one JSON object: header, metadata, placement, "
                   "hyperparameters")


def run(args) -> int:
    args.model = common.model_arg(args.model)
    if args.json:
        if args.plan or args.plot:
            raise ArgumentError("--json prints the file's facts; leave out --plan and --plot")
        common.print_json(_info_json(args.model, args.tensors))
        return 0
    if args.plot:  # (what the plot needs, before the report: not a report and then an error)
        coverage._pyplot()
        if args.stats and not os.path.isfile(args.stats):
            raise FileNotFoundError(f"--stats {args.stats}: no such file")
    if args.plan:  # where each layer would run, without loading the weights
        p = plan.make(args.model, n_ctx=args.ctx, n_seq=args.parallel, kv_vram=args.kv_vram, **common.device(args))
        common.say_what_the_cpu_ignores(args, p)
        print(p, end="")
        return 0
    with gguf.open(args.model) as f:
        print(f.summary())
        print()
        for k, v in f.metadata.items():
            if isinstance(v, np.ndarray) or isinstance(v, list):
                shown = f"[{len(v)} x {f.metadata_types[k].removeprefix('array[').rstrip(']')}]"
            else:
                shown = repr(v) if not isinstance(v, str) or len(v) < 200 else repr(v[:200] + "...")
            print(f"  {k:45s} = {shown}")
        if args.tensors:
            print()
            for t in f.tensors:
                print(f"  {t.name:40s} {t.type_name:6s} {str(list(t.shape)):20s} {t.n_bytes:>12,d} bytes")
        placed = _show_placement(f)
    try:
        hp = _core.Model(args.model).hparams
        print()
        print("  runs as: " + ", ".join(f"{k}={v}" for k, v in hp.items()))
        _show_companions(companions(args.model))
    except OptimlError as e:
        print(f"\n  cannot run: {e}")
    if args.plot:
        _plot_info(args, placed)
    return 0


def _info_json(path: str, tensors: bool) -> dict:
    """optiml info --json: the header, the metadata (arrays as their type and length), the placement of a
    placed file, and the hyperparameters the engine runs with (or why it cannot run the file)."""
    with gguf.open(path) as f:
        meta = {}
        for k, v in f.metadata.items():
            if isinstance(v, (np.ndarray, list)):
                meta[k] = {"type": f.metadata_types[k], "length": len(v)}
            else:
                meta[k] = v
        counts: dict[str, int] = {}
        for t in f.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        out = {"path": path, "gguf_version": f.version, "file_size": f.file_size, "n_tensors": len(f.tensors),
               "tensor_types": counts, "alignment": f.alignment, "data_offset": f.data_offset, "metadata": meta}
        if tensors:
            out["tensors"] = [{"name": t.name, "type": t.type_name, "shape": list(t.shape), "n_bytes": t.n_bytes}
                              for t in f.tensors]
        out["placement"] = read_placement(f)
    try:
        out["hparams"] = _core.Model(path).hparams
        out["companions"] = companions(path)
    except OptimlError as e:
        out["hparams"], out["companions"], out["cannot_run"] = None, None, str(e)
    return out


def _show_companions(c: dict) -> None:
    """What a Model with the defaults picks up besides the weights (engine.companions), and why."""
    sp, pred, pl = c["sparsity"], c["predictors"], c["placement"]
    print(f"  sparsity (auto): {sp['mode']}: {sp['why']}")
    name = os.path.basename(pred["path"])
    state = "not found" if not pred["found"] else ("used" if pred["used"] else "found, not used")
    print(f"  predictors (auto): {name} {state}: {pred['why']}")
    why = pl["why"]
    if pl["in_file"] and not pl["used"] and "--device cuda" in why:  # (a placement runs split on cpu:1 too)
        why += "; or with --device cpu:1 (device='cpu:1'), a second CPU device, to test the split without a GPU"
    print(f"  placement: {'in the file, ' + ('used' if pl['used'] else 'not used') if pl['in_file'] else 'none'}: "
          f"{why}")
    if not c["files"]:
        print("  companion files beside the model: none")
    for f in c["files"]:
        print(f"  companion file: {os.path.basename(f['path'])} ({f['kind']}): {'used' if f['used'] else 'not used'}: "
              f"{f['why']}")


def _show_expert_placement(pl: dict) -> None:
    experts, cov = pl["gpu_experts"], pl.get("coverage", [])
    print()
    print(f"  placement (optiml.placement.*, v{pl.get('version')}): whole experts, each layer's hottest first; the "
          "weights are the source's")
    print(f"  {'layer':>5}  {'experts':>7}  {'routings':>8}  on the GPU (hottest first)")
    for l, ids in enumerate(experts):
        shown = " ".join(map(str, ids[:12])) + (" ..." if len(ids) > 12 else "")
        print(f"  {l:5d}  {len(ids):7d}  {cov[l] if l < len(cov) else float('nan'):8.1%}  {shown}")
    solver = pl.get("solver", {})
    print(f"  budget {mib(pl.get('vram_budget', 0), '.2f')}, used {mib(pl.get('vram_used', 0), '.2f')} "
          f"(fixed {mib(pl.get('fixed_bytes', 0), '.2f')}), ctx {pl.get('ctx')}; solver {solver.get('method')} "
          f"{solver.get('status')}; estimated {pl.get('est_token_ms', float('nan')):.2f} ms/token")


def _show_placement(f) -> dict | None:
    """Prints the placement table of a placed file; returns read_placement's dict (None if unplaced)."""
    pl = read_placement(f)
    if pl is None:
        return None
    if pl["form"] == "experts":
        _show_expert_placement(pl)
        return pl
    k = pl["gpu_neurons"]
    cov = pl.get("coverage", [float("nan")] * len(k))
    sizes = layer_bytes(f, k)
    n_ff = ffn_layout(f)[1]
    print()
    how = {"hot-first": "FFN neurons hot-first",
           "coactive": "FFN neurons hot-first for the GPU share, the CPU's after it in co-activation order (neurons "
                       "that fire together side by side)"}.get(pl.get("order", "hot-first"), f"FFN neurons in a "
                                                                                     f"{pl.get('order')} order")
    print(f"  placement (optiml.placement.*, v{pl.get('version')}): {how}, "
          f"layer l's GPU share is placed neurons [0, k_l)")
    if pl["form"] == "neuron_order":
        print("  form: neuron_order: the weights keep the source's order (exact); optiml.placement.neuron_order "
              "maps placed to stored neurons and the engine gathers at load")
    else:
        how = f"; v1 file: quantized down tensors requantized to {pl['down_type']}" if pl.get("down_type") else ""
        print(f"  form: permuted: the FFN weights are stored in placed order{how}")
    print(f"  {'layer':>5}  {'k_l':>6} / {'n_ff':<6} {'share':>6}  {'coverage':>8}  {'GPU bytes':>13}  {'CPU bytes':>13}")
    for l, (kl, c, (g, cpu)) in enumerate(zip(k, cov, sizes)):
        print(f"  {l:5d}  {kl:6d} / {n_ff:<6d} {kl / n_ff:6.1%}  {c:8.1%}  {mib(g, '9.2f')}  {mib(cpu, '9.2f')}")
    gpu, cpu = sum(s[0] for s in sizes), sum(s[1] for s in sizes)
    tot_k = sum(k)
    print(f"  {'total':>5}  {tot_k:6d} / {n_ff * len(k):<6d} {tot_k / (n_ff * len(k)):6.1%}  "
          f"{sum(cov) / max(len(cov), 1):8.1%}  {mib(gpu, '9.2f')}  {mib(cpu, '9.2f')}   (coverage: mean of layers)")
    solver = pl.get("solver", {})
    print(f"  budget {mib(pl.get('vram_budget', 0), '.2f')}, used {mib(pl.get('vram_used', 0), '.2f')} "
          f"(fixed {mib(pl.get('fixed_bytes', 0), '.2f')}), ctx {pl.get('ctx')}, group {pl.get('group_size')}")
    if pl.get("fixed_bytes", 0) > pl.get("vram_budget", 0) and pl.get("gpu_attention"):
        print("  " + attention_line(pl["gpu_attention"], solver.get("estimate", {}).get("output_on_gpu", False),
                                    pl["fixed_bytes"], pl.get("ctx"), solver.get("method") == "all-cpu"))
    gap = solver.get("gap")  # null where no program ran (greedy, all-cpu)
    print(f"  solver: {solver.get('method')} {solver.get('status')}, gap {'n/a' if gap is None else format(gap, '.3g')}, "
          f"{solver.get('solve_s', 0):.2f} s; estimated {pl.get('est_token_ms', float('nan')):.2f} ms/token")
    est = solver.get("estimate")
    if est:  # what the estimate assumed (files from optiml solve since the time model)
        parts = ", ".join(f"{k} {v:.3f}" for k, v in est.get("cpu_only_parts_ms", {}).items())
        print(f"  estimate: decode steps attending to {est.get('positions')} positions, predictors "
              f"{est.get('predictors') or 'none'}, the output matrix on the {'GPU' if est.get('output_on_gpu') else 'CPU'}; "
              f"all on the CPU {est.get('cpu_only_ms', float('nan')):.2f} ms ({parts} ms)")
    if pl.get("hardware"):
        print(f"  hardware: {json.dumps(pl['hardware'], sort_keys=True)}")
    print(f"  stats: {pl.get('stats.tokens')} tokens from {str(pl.get('stats.sources', '')).replace(chr(10), ', ')} "
          f"(fingerprint {pl.get('stats.fingerprint')})")
    return pl


def _plot_info(args, placed: dict | None) -> None:
    """optiml info --plot: curves from --stats when given, else from the file's placement metadata."""
    name = os.path.basename(args.model)
    k = placed["gpu_neurons"] if placed and placed["form"] != "experts" else None
    unit = "neuron"
    if args.stats:
        st = stats.load(args.stats)
        if placed is None:
            st.check_model(args.model)
        # A mixture of experts' stats count routings per expert (its neurons' firings are not recorded): the
        # curves of its experts, and the experts each layer of an expert placement holds on the device.
        use = st.expert_count / max(1, st.n_tokens) if st.is_moe else st.freq
        unit = "expert" if st.is_moe else "neuron"
        if st.is_moe and placed is not None and placed["form"] == "experts":
            k = [len(e) for e in placed["gpu_experts"]]
        n_ff = use.shape[1]
        ranks = curve_ranks(n_ff)
        freq = -np.sort(-use, axis=1)[:, ranks - 1]
        cov = coverage_curve(use)[:, ranks - 1]
        src = f"stats: {st.n_tokens} tokens"
    elif placed is not None and placed["form"] == "experts":
        raise OptimlError(f"{args.model}: an expert placement keeps no neuron curves to plot; give the activation "
                          "stats (--stats STATS.npz)")
    elif placed is not None:
        ranks = np.asarray(placed["curve_ranks"])
        freq, cov = placed["curve_freq"], placed["curve_coverage"]
        n_ff = int(ranks[-1])
        src = f"placement metadata: {placed.get('stats.tokens')} tokens"
    else:
        raise OptimlError(f"{args.model} has no placement to plot; give the activation stats: --stats STATS.npz")
    plot(args.plot, ranks, freq, cov, n_ff, gpu_neurons=k, title=f"{name} ({src})", unit=unit)
    print(f"\n  wrote {args.plot}")
