"""optiml bench: prompt processing and generation speed (tokens/s), or with --timeline where a step's time goes,
or with --launches what a step launches on the device and the bytes it moves."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
from gguf import LlamaFileType

from .. import _core
from .._core import ArgumentError
from ..engine.sparsity import describe, format_skipped
from ..engine.timing import bench_tests
from ..formats import gguf
from . import common


def add_arguments(p) -> None:
    common.add_model_args(p)
    p.add_argument("-p", "--n-prompt", action="append", metavar="N[,N...]",
                   help="prompt tests: N tokens as one batch from an empty context (default 512; 0: none; a comma "
                        "list or the flag again for several)")
    p.add_argument("-n", "--n-gen", action="append", metavar="N[,N...]",
                   help="generation tests: N one-token steps from an empty context (default 128; 0: none)")
    p.add_argument("-pg", "--prompt-gen", action="append", metavar="PP,TG",
                   help="a prompt of PP tokens and TG steps after it, timed together (again for more)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs of each test (default 5)")
    p.add_argument("--no-warmup", action="store_true", help="no untimed run before each test's timed ones (the "
                   "warm-up also measures the FFN neurons skipped)")
    p.add_argument("-o", "--output", choices=("md", "csv", "json", "jsonl"), default="md",
                   help="the table (md, default), csv, json (a list of tests) or jsonl (one test a line), with the "
                        "fields llama-bench prints")
    p.add_argument("--json", action="store_const", dest="output", const="json", help="the same as -o json")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="instead of the speed table: time N decode steps op by op on each device and print where "
                        "the time goes per layer (busy, copies, waits, overlap of the host and the device)")
    p.add_argument("--trace", metavar="FILE", help="also write the timeline's spans as a Chrome trace (JSON; alone: a "
                                                   "timeline of 8 steps)")
    p.add_argument("--launches", type=int, default=0, metavar="N",
                   help="instead of the speed table: decode N steps and print the kernels and copies the device "
                        "launched per layer and kind, and the bytes of weights, activations and KV cache they "
                        "move (CUDA, or its CPU emulator; with -b, steps of that many tokens; -o json for JSON)")
    p.add_argument("-b", "--batch", type=int, default=1, help="with --launches: tokens per step")
    common.add_device_args(p)


def _counts(given: list[str] | None, flag: str, default: int) -> list[int]:
    """The numbers of -p or -n: comma lists, the flag given again adds more; 0 is no test."""
    out = []
    for text in given or [str(default)]:
        for part in text.split(","):
            try:
                v = int(part)
            except ValueError:
                raise ArgumentError(f"{flag} takes whole numbers (a comma list for several), got {part!r}") from None
            if v < 0:
                raise ArgumentError(f"{flag} must be 0 (no test) or more, got {v}")
            out.append(v)
    return [v for v in out if v > 0]


def _tests(args) -> list[tuple[int, int]]:
    """(n_prompt, n_gen) of each test, in llama-bench's order: the prompt tests, the generation tests, then -pg."""
    tests = [(n, 0) for n in _counts(args.n_prompt, "-p/--n-prompt", 512)]
    tests += [(0, n) for n in _counts(args.n_gen, "-n/--n-gen", 128)]
    for text in args.prompt_gen or []:
        parts = text.split(",")
        if len(parts) != 2 or not all(x.strip().isdigit() for x in parts) or min(int(x) for x in parts) < 1:
            raise ArgumentError(f"-pg takes PP,TG: a prompt's tokens and the steps after it (both at least 1), "
                                f"got {text!r}")
        tests.append((int(parts[0]), int(parts[1])))
    if not tests:
        raise ArgumentError("no test to run: -p 0 and -n 0 leave none; give -p, -n or -pg a size")
    return tests


def run(args) -> int:
    for flag, v in (("-r/--repetitions", args.repetitions), ("-b/--batch", args.batch)):
        if v < 1:
            raise ArgumentError(f"{flag} must be at least 1, got {v}")
    for flag, v in (("--timeline", args.timeline), ("--launches", args.launches)):
        if v < 0:
            raise ArgumentError(f"{flag} must be a number of steps (at least 1), got {v}")
    if args.launches and (args.timeline or args.trace):
        raise ArgumentError("--launches and --timeline/--trace are two reports of their own: give one")
    if args.batch != 1 and not args.launches:
        raise ArgumentError("-b/--batch sets the tokens per step of --launches (llama-bench's -b, the batch size "
                            "of prompt tests, has no counterpart: a prompt test is one batch); give --launches N too")
    if args.output in ("csv", "jsonl") and (args.launches or args.timeline or args.trace):
        raise ArgumentError(f"-o {args.output} is for the speed table; --launches and --timeline print md or json")
    tests = [] if (args.launches or args.timeline or args.trace) else _tests(args)
    need = max([p + g for p, g in tests] + [args.timeline or 0, (args.launches or 0) * args.batch]) + 64
    if args.ctx is not None and args.ctx < need:
        raise ArgumentError(f"--ctx {args.ctx} is too small for this benchmark: it needs {need} positions "
                            "(the longest test and 64 more)")
    m = common.load(args, n_ctx=args.ctx or need)
    if args.launches:
        c = m.launches(args.launches, batch=args.batch)
        if args.output == "json":
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
    about = _about(m, args)
    rows = [{**about, **r} for r in bench_tests(m, tests, args.repetitions, warmup=not args.no_warmup)]
    for r in rows:  # (the sparsity of each test's warm-up, beside the mode it ran with)
        r["sparsity"] = {"mode": m.sparsity, "predictors": m.predictors, **(r["sparsity"] or {})}
    if args.output == "json":
        common.print_json(rows)
    elif args.output == "jsonl":
        for r in rows:
            print(json.dumps(r))
    elif args.output == "csv":
        w = csv.writer(sys.stdout)
        fields = [k for k in rows[0] if k != "sparsity"]
        w.writerow(fields)
        for r in rows:
            w.writerow([",".join(f"{x:.6f}" for x in r[k]) if k == "samples_ts" else r[k] for k in fields])
    else:
        _print_table(m, rows, args.repetitions)
    return 0


def _about(m, args) -> dict:
    """The model's columns of llama-bench's table: a description (architecture, size, file type), its bytes and
    parameters, the backend and threads."""
    with gguf.open(m.path) as f:
        n_params = sum(int(np.prod(t.shape)) for t in f.tensors)
        size = sum(t.n_bytes for t in f.tensors)
        ftype = f.metadata.get("general.file_type")
    try:
        ftype_name = LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        ftype_name = "?"
    label = f"{n_params / 1e9:.0f}B" if n_params >= 1e9 else f"{n_params / 1e6:.0f}M"
    return {"model_filename": m.path, "model_type": f"{m.hparams['arch']} {label} {ftype_name}",
            "model_size": size, "model_n_params": n_params, "backends": "CUDA" if m.plan.device.startswith("cuda") else "CPU",  # (cpu:1 emulates one)
            "n_threads": args.threads or _core.get_num_threads(), "simd": _core.system_info()["simd"]}


def _print_table(m, rows: list[dict], repetitions: int) -> None:
    """llama-bench's markdown table (t/s: the mean of the runs and their standard deviation), then the FFN
    neurons each test skipped."""
    r0 = rows[0]
    size = r0["model_size"]
    cells = [[r["model_type"], f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.2f} MiB",
              f"{r['model_n_params'] / 1e9:.2f} B" if r["model_n_params"] >= 1e9 else f"{r['model_n_params'] / 1e6:.2f} M",
              r["backends"], str(r["n_threads"]), r["test"], f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"] for r in rows]
    head = ["model", "size", "params", "backend", "threads", "test", "t/s"]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    right = {1, 2, 4, 5, 6}  # (numbers right-aligned, as llama-bench)

    def line(vals):
        return "| " + " | ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))) + " |"

    print(line(head))
    print("| " + " | ".join(("-" * (w - 1) + ":") if i in right else "-" * w for i, w in enumerate(widths)) + " |")
    for c in cells:
        print(line(c))
    ffn = describe(m.sparsity, m.predictors, m.sparsity_note)
    if m.sparsity != "none" or m.predictors:  # (dense without predictors skips nothing)
        skipped = [f"{r['test']}{' ' + k if r['n_prompt'] and r['n_gen'] else ''} {format_skipped(r['sparsity'][k])}"
                   for r in rows for k in ("pp", "tg") if r["sparsity"].get(k)]
        ffn += f"; neurons skipped: {', '.join(skipped) if skipped else 'not measured (--no-warmup)'}"
    print(f"{repetitions} runs a test; simd: {r0['simd']}; FFN: {ffn}")
