#!/usr/bin/env python3
"""Nsight Compute's view of decode steps on the GPU: every kernel a step launches, its time and the DRAM
bytes it moved, summed by kernel (issue #43: where a layer's time goes, and how near the memory's rate
each product streams).

    python tools/bench/ncu_decode.py -m MODEL.gguf [--steps 2] [--batch 1] [--ncu ncu] [--json OUT]

Runs itself under `ncu` in a child that loads the model on the GPU (every layer there), reads a short
prompt, decodes --warmup steps unprofiled, then --steps profiled steps between cuProfilerStart and
cuProfilerStop (ncu --profile-from-start off; --from-start profiles the whole run instead, for a driver
where that fails). The child records with CUDA graphs off (OPTIML_CUDA_GRAPHS=0): the same kernels a graph
replays, launched one by one. ncu keeps the clocks as the GPU sets them (--clock-control none) and writes a
report (REPORT.ncu-rep, kept for Nsight Compute's GUI), which is read back as CSV.

Prints, per kernel and grid: launches per step, microseconds each (median), DRAM bytes per launch, GB/s,
and DRAM throughput in % of the peak sustained; then a step's total. The sum of the kernels' times is not a
step's wall time: ncu runs each kernel alone and flushes the caches before it (its --cache-control all), so
short kernels read long and nothing overlaps; the bytes and the % of peak are the figures to read.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import statistics
import subprocess
import sys

METRICS = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed"]


# ---- the child: the decode steps ncu profiles ------------------------------------------------------------
def profiler(start: bool) -> None:
    """cuProfilerStart/Stop through the driver (one per process, whichever runtime the extension links), in
    the primary context of device 0, the one the CUDA runtime uses."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise SystemExit(f"no CUDA driver here ({e}): ncu_decode.py profiles a GPU's kernels") from None
    ctx = ctypes.c_void_p()
    rc = cu.cuInit(0) or cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) or cu.cuCtxPushCurrent(ctx)
    if rc:
        raise SystemExit(f"the CUDA driver refused the primary context (CUresult {rc}): use --from-start")
    rc = cu.cuProfilerStart() if start else cu.cuProfilerStop()
    popped = ctypes.c_void_p()
    cu.cuCtxPopCurrent(ctypes.byref(popped))
    cu.cuDevicePrimaryCtxRelease(0)
    if rc:
        raise SystemExit(f"cuProfiler{'Start' if start else 'Stop'} failed (CUresult {rc}): use --from-start")


def child(a) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness  # noqa: F401  (optiml importable from this checkout)
    import optiml
    from optiml import Batch

    with optiml.Model(a.model, n_ctx=(64 + a.warmup + a.steps) * a.batch, n_seq=a.batch, device="cuda") as m:
        prompt = [m.tokenizer.bos_id if m.tokenizer.bos_id >= 0 else 1] + [100 + i for i in range(7)]
        b = Batch()
        for s in range(a.batch):
            b.add_sequence(prompt, s, 0, logits="last")
        m.decode(b)

        def step(i):
            b = Batch()
            for s in range(a.batch):
                b.add(200 + i, s, len(prompt) + i, logits=True)
            m.decode(b)  # returns the logits: the step has finished on the device

        for i in range(a.warmup):
            step(i)
        if not a.from_start:
            profiler(True)
        for i in range(a.warmup, a.warmup + a.steps):
            step(i)
        if not a.from_start:
            profiler(False)
    return 0


# ---- the parent: ncu, then its report read back ----------------------------------------------------------
def read_raw_csv(text: str) -> list[dict]:
    """ncu --csv --page raw --print-units base: a row of names, a row of units, then one row per kernel
    launch. Returns the launches as dicts of strings (ncu's own messages before the header skipped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError(f"no ncu CSV header in: {text[:400]!r}")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    names, body = rows[0], rows[1:]
    if body and not body[0][0]:  # the units (an empty ID)
        body = body[1:]
    return [dict(zip(names, r)) for r in body if len(r) == len(names)]


def number(s: str) -> float:
    s = s.replace(",", "").strip()
    return float(s) if s and s != "n/a" else float("nan")


def summarize(launches: list[dict], steps: int) -> dict:
    """Per (kernel name, grid size): launches per step, median microseconds, DRAM bytes per launch, GB/s over
    its total time, time-weighted % of the DRAM peak; and a step's totals."""
    groups: dict = {}
    for r in launches:
        key = (r["Kernel Name"], r.get("Grid Size", ""))
        groups.setdefault(key, []).append(r)
    kernels, total_s, total_bytes = [], 0.0, 0.0
    for (name, grid), rs in groups.items():
        secs = [number(r["gpu__time_duration.sum"]) * 1e-9 for r in rs]
        byts = [number(r["dram__bytes_read.sum"]) + number(r["dram__bytes_write.sum"]) for r in rs]
        pct = [number(r["dram__throughput.avg.pct_of_peak_sustained_elapsed"]) for r in rs]
        t = sum(secs)
        kernels.append({"kernel": name, "grid": grid, "per_step": len(rs) / steps,
                        "us_each": statistics.median(secs) * 1e6, "bytes_each": sum(byts) / len(rs),
                        "gb_s": sum(byts) / t / 1e9 if t > 0 else float("nan"),
                        "pct_peak": sum(p * s for p, s in zip(pct, secs)) / t if t > 0 else float("nan"),
                        "us_per_step": t / steps * 1e6})
        total_s += t
        total_bytes += sum(byts)
    kernels.sort(key=lambda k: -k["us_per_step"])
    return {"steps": steps, "kernels": kernels, "kernels_per_step": len(launches) / steps,
            "us_per_step": total_s / steps * 1e6, "bytes_per_step": total_bytes / steps,
            "gb_s": total_bytes / total_s / 1e9 if total_s > 0 else float("nan")}


def table(s: dict) -> str:
    out = [f"{'kernel':44} {'grid':>16} {'/step':>6} {'us each':>8} {'MB each':>8} {'GB/s':>7} {'% peak':>7} "
           f"{'us/step':>8}"]
    for k in s["kernels"]:
        out.append(f"{k['kernel'][:44]:44} {k['grid'][:16]:>16} {k['per_step']:6.2f} {k['us_each']:8.1f} "
                   f"{k['bytes_each'] / 1e6:8.2f} {k['gb_s']:7.0f} {k['pct_peak']:7.1f} {k['us_per_step']:8.1f}")
    out.append(f"a step: {s['kernels_per_step']:.0f} kernels, {s['us_per_step']:.0f} us of kernel time (each alone, "
               f"caches flushed), {s['bytes_per_step'] / 1e6:.1f} MB of DRAM traffic, {s['gb_s']:.0f} GB/s over "
               "the kernels' time")
    return "\n".join(out)


def parent(a) -> int:
    ncu = shutil.which(a.ncu or "ncu") or (None if a.ncu else shutil.which("/usr/local/cuda/bin/ncu"))
    if ncu is None:
        raise SystemExit(f"no Nsight Compute: {a.ncu or 'ncu'} is not a program here (it comes with the CUDA "
                         "toolkit: /usr/local/cuda/bin/ncu, or give --ncu PATH)")
    report = a.report or os.path.join(os.path.dirname(os.path.abspath(a.json)) if a.json else ".", "ncu-decode")
    cmd = [ncu, "--clock-control", "none", "--metrics", ",".join(METRICS), "-f", "-o", report]
    if not a.from_start:
        cmd += ["--profile-from-start", "off"]
    cmd += [sys.executable, os.path.abspath(__file__), "--child", "-m", a.model, "--steps", str(a.steps),
            "--batch", str(a.batch), "--warmup", str(a.warmup)] + (["--from-start"] if a.from_start else [])
    env = dict(os.environ, OPTIML_CUDA_GRAPHS="0")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"ncu or the profiled child failed (exit {run.returncode}): {' '.join(cmd)}\n"
                         f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    got = subprocess.run([ncu, "--import", report + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base"],
                         capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"ncu --import {report}.ncu-rep failed (exit {got.returncode}):\n{got.stderr[-3000:]}")
    launches = read_raw_csv(got.stdout)
    if not launches:
        raise SystemExit(f"ncu profiled no kernel (try --from-start); its output:\n{run.stdout[-3000:]}\n"
                         f"{run.stderr[-3000:]}")
    steps = 1 if a.from_start else a.steps  # --from-start: the totals are the whole run's
    s = summarize(launches, steps)
    print(f"Nsight Compute, {a.model}: {'the whole run' if a.from_start else f'{a.steps} decode steps'} of batch "
          f"{a.batch} (graphs off, clocks as set, caches flushed per kernel); report {report}.ncu-rep")
    print(table(s))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--steps", type=int, default=2, help="decode steps profiled")
    ap.add_argument("--warmup", type=int, default=2, help="decode steps before them, not profiled")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--ncu", default=None, help="the ncu program (default: ncu on the PATH, else the CUDA toolkit's)")
    ap.add_argument("--from-start", action="store_true", help="profile the whole run (prompt and warm-up too)")
    ap.add_argument("--report", default=None, help="the report's path without .ncu-rep (default: beside --json)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    return child(a) if a.child else parent(a)


if __name__ == "__main__":
    sys.exit(main())
