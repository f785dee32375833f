#!/usr/bin/env python3
"""The solver's time model against the engine, on this machine's CPU (issue #44: a time model that predicts).

    python tools/bench/time_model.py -m MODEL.gguf [--stats STATS.npz] [--predictors P.gguf] -t 2 --rounds 5
    python tools/bench/time_model.py -m smollm2 -t 2          # a known model name, as the other benchmarks take

Each round measures the machine (`optiml hw`'s CPU measurements: read bandwidth, dense and row-sparse
product rates of the model's weight types) and then, at once, times decode steps op by op (Model.timeline,
the CPU alone, with the predictors when given); the solver's estimate of the same step comes from that
round's measurements (optiml.offline.solve.solve_placement with no device memory: Placement.cpu_only_parts,
at the positions the steps attend to). Machines shared with others change speed from minute to minute, so
each ratio takes its measurements and its steps from the same moment, and the medians over rounds are
printed last. Without --stats, the model is profiled on the shared text (kept in --workdir).

The GPU half of the model (the device's share, launches, copies) is checked by tools/bench/hybrid.py, which
prints the estimate beside each measured hybrid step on the GPU machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import warnings

import harness

import optiml
from optiml import gguf, quant

ostats = harness.internal("stats")
solve = harness.internal("solve")
hardware = harness.internal("hardware")

PROMPT = "The history of the printing press begins"
PARTS = ("attention", "ffn", "output")


def weight_types(path: str) -> list[str]:
    """The quantized types of a model's matrices, as `optiml hw --types` names them."""
    with gguf.open(path) as f:
        names = {quant.type_info(t.type).name.lower() for t in f.tensors if len(t.shape) > 1}
    return sorted(n for n in names if n not in ("f32",))


def stats_for(path: str, workdir: str, threads: int) -> str:
    out = os.path.join(workdir, os.path.basename(path)[:-5] + ".stats.npz")
    if not os.path.exists(out):
        cmd = [sys.executable, "-m", "optiml", "profile", "-m", path, "--data", str(harness.TEXT), "--tokens", "2000",
               "-o", out, "-t", str(threads), "-q"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"optiml profile failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return out


def measured_parts(tl) -> dict:
    """Seconds per step of each part, from a CPU timeline: attention and FFN over the layers, the logits."""
    n = max(tl.n_tokens, 1)
    rows = tl.layers()
    got = {"attention": sum(r.host_ops.get("attention", 0.0) for r in rows if r.layer >= 0) / n,
           "ffn": sum(r.host_ops.get("ffn", 0.0) for r in rows if r.layer >= 0) / n,
           "output": sum(r.host_ops.get("logits", 0.0) for r in rows if r.layer < 0) / n}
    got["step"] = sum(r.host_busy for r in rows) / n
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="a GGUF file or a known model name (smollm2, gemma3, ...)")
    ap.add_argument("--stats", default=None, help="optiml profile's statistics of the model (default: profiled here)")
    ap.add_argument("--predictors", default=None, help="a predictor file the model runs with (optiml train-predictors)")
    ap.add_argument("-t", "--threads", type=harness.positive, default=optiml._core.physical_core_count())
    ap.add_argument("--rounds", type=harness.positive, default=5)
    ap.add_argument("--tokens", type=harness.positive, default=16, help="decode steps timed per round")
    ap.add_argument("--ctx", type=harness.positive, default=512)
    ap.add_argument("--workdir", default=str(harness.BUILD / "bench-time-model"))
    args, res = harness.parse(ap, "time_model")
    for opt, path in (("--stats", args.stats), ("--predictors", args.predictors)):
        if path and not os.path.isfile(path):
            ap.error(f"{opt} {path}: no such file")
    args.model = harness.model_arg(ap, args.model)
    os.makedirs(args.workdir, exist_ok=True)
    stats_path = args.stats or stats_for(args.model, args.workdir, args.threads)
    st = ostats.load(stats_path)
    types = weight_types(args.model)
    print(f"{os.path.basename(args.model)}, {args.threads} threads, types {', '.join(types)}"
          + (f", predictors {os.path.basename(args.predictors)}" if args.predictors else ""))
    ratios = {k: [] for k in (*PARTS, "step")}
    with optiml.Model(args.model, n_ctx=args.ctx, n_threads=args.threads, device="cpu",
                      predictors=args.predictors) as m:
        positions = len(m.tokenize(PROMPT)) + args.tokens // 2
        for r in range(args.rounds):
            hw = hardware.Hardware.measure(types=types, n_threads=args.threads)
            got = measured_parts(m.timeline(args.tokens, PROMPT))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", solve.SolveWarning)
                p = solve.solve_placement(args.model, st, 0, hw, ctx=args.ctx, positions=positions,
                                          predictors=args.predictors)
            est = dict(p.cpu_only_parts, step=p.cpu_only_token_s)
            line = []
            for k in (*PARTS, "step"):
                ratios[k].append(got[k] / est[k])
                line.append(f"{k} {got[k] * 1e3:.3f}/{est[k] * 1e3:.3f} ms ({got[k] / est[k]:.2f}x)")
                res.add(round=r, part=k, measured_ms=got[k] * 1e3, estimate_ms=est[k] * 1e3)
            dense = ", ".join(f"{t} {v / 1e9:.1f}" for t, v in hw.cpu_dense.items())
            print(f"round {r}: CPU {hw.cpu_bandwidth / 1e9:.1f} GB/s, dense {dense} GB/s; measured/estimate: "
                  + "; ".join(line), flush=True)
    print("\nmedian measured / estimate over the rounds: "
          + ", ".join(f"{k} {statistics.median(v):.2f}x" for k, v in ratios.items()))
    res.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
