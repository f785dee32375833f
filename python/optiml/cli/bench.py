"""optiml bench: prompt processing and generation speed (tokens/s), or with --timeline where a step's time goes,
or with --launches what a step launches on the device and the bytes it moves."""

from __future__ import annotations

from .. import _core
from .._core import ArgumentError
from ..engine.sparsity import describe, format_skipped
from ..engine.timing import bench_model
from . import common


def add_arguments(p) -> None:
    common.add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=128)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="instead of the speed table: time N decode steps op by op on each device and print where "
                        "the time goes per layer (busy, copies, waits, overlap of the host and the device)")
    p.add_argument("--trace", metavar="FILE", help="also write the timeline's spans as a Chrome trace (JSON; alone: a "
                                                   "timeline of 8 steps)")
    p.add_argument("--launches", type=int, default=0, metavar="N",
                   help="instead of the speed table: decode N steps and print the kernels and copies the device "
                        "launched per layer and kind, and the bytes of weights, activations and KV cache they "
                        "move (CUDA, or its CPU emulator; with -b, steps of that many tokens; --json for JSON)")
    p.add_argument("-b", "--batch", type=int, default=1, help="with --launches: tokens per step")
    common.add_device_args(p)


def run(args) -> int:
    for flag, v in (("-p/--n-prompt", args.n_prompt), ("-n/--n-gen", args.n_gen), ("-r/--repetitions", args.repetitions),
                    ("-b/--batch", args.batch)):
        if v < 1:
            raise ArgumentError(f"{flag} must be at least 1, got {v}")
    for flag, v in (("--timeline", args.timeline), ("--launches", args.launches)):
        if v < 0:
            raise ArgumentError(f"{flag} must be a number of steps (at least 1), got {v}")
    if args.launches and (args.timeline or args.trace):
        raise ArgumentError("--launches and --timeline/--trace are two reports of their own: give one")
    if args.batch != 1 and not args.launches:
        raise ArgumentError("-b/--batch sets the tokens per step of --launches; give --launches N too")
    need = max(args.n_prompt, args.n_gen, args.timeline or 0, (args.launches or 0) * args.batch) + 64
    if args.ctx is not None and args.ctx < need:
        raise ArgumentError(f"--ctx {args.ctx} is too small for this benchmark: it needs {need} positions "
                            "(the longest run and 64 more)")
    m = common.load(args, n_ctx=args.ctx or need)
    if args.launches:
        c = m.launches(args.launches, batch=args.batch)
        if args.json:
            common.print_json({"model": args.model, "path": m.path, **c.to_dict()})
        else:
            print(c)
        return 0
    if args.timeline or args.trace:
        t = m.timeline(args.timeline or 8)
        if args.trace:
            t.to_chrome_trace(args.trace)
        print(t)
        if args.trace:
            print(f"wrote {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
        return 0
    r = bench_model(m, args.n_prompt, args.n_gen, args.repetitions)
    hp = m.hparams
    # the FFN neurons skipped, measured on the warm-up run: the prompt, and the generation's mean and steps
    sparsity = {"mode": m.sparsity, "predictors": m.predictors, "pp_skipped": r["pp_sparsity"]["skipped"],
                "tg_skipped": r["tg_sparsity"]["skipped"], "tg_skipped_per_step": r["tg_sparsity"]["per_step"]}
    if args.json:
        common.print_json({"model": args.model, "path": m.path, "arch": hp["arch"], "weight_bytes": hp["weight_bytes"],
                           "threads": args.threads or _core.get_num_threads(), "simd": _core.system_info()["simd"],
                           "n_prompt": args.n_prompt, "n_gen": args.n_gen, "repetitions": args.repetitions,
                           "pp_tokens_per_s": r["pp"], "tg_tokens_per_s": r["tg"],
                           "pp_runs": r["pp_runs"], "tg_runs": r["tg_runs"], "sparsity": sparsity})
        return 0
    print(f"model: {args.model} ({hp['arch']}, {hp['weight_bytes'] / 2**20:.1f} MiB), "
          f"threads: {args.threads or _core.get_num_threads()}, simd: {_core.system_info()['simd']}")
    print(f"| test  | tokens/s (median of {args.repetitions}) |")
    print("|-------|-----------|")
    print(f"| pp{args.n_prompt:<3} | {r['pp']:9.2f} |")
    print(f"| tg{args.n_gen:<3} | {r['tg']:9.2f} |")
    print(f"FFN: {describe(m.sparsity, m.predictors, m.sparsity_note)}; neurons skipped: pp{args.n_prompt} "
          f"{format_skipped(r['pp_sparsity'])}, tg{args.n_gen} {format_skipped(r['tg_sparsity'])}")
    return 0
