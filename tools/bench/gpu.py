#!/usr/bin/env python3
"""GPU speed of OptiML against llama.cpp's CUDA build, side by side, one model at a time.

    python tools/bench/gpu.py -m MODEL.gguf [--llama-bench build/llama-cuda/bin/llama-bench]
        [--llama-batched-bench .../llama-batched-bench] [--tg 128] [--pp 512] [--reps 3]

For each model: decode at batch 1 (tg), 8 sequences decoded together (aggregate tokens/s), and prefill
(pp), OptiML with device="cuda" (every layer on the GPU) and llama.cpp with -ngl 99 (llama-bench for pp
and tg, llama-batched-bench -npl 8 for the batch). Prints tokens/s, our ratio to llama.cpp, and for
batch-1 decode the share of the GPU's memory bandwidth used: the bytes of weights the device reads per
token times tokens/s, over the peak (a table of known GPUs, else a measured device-to-device copy).
Medians of --reps runs. With --launches N (default 4; 0: off) it then decodes N more steps of one token
and of 8 and prints what each launched (Model.launches: kernels per layer and kind, bytes of weights,
activations and KV cache), and the bandwidth column gains the share of the peak that the counted bytes
per token at the measured tg speed come to. --unfused measures OptiML again with OPTIML_CUDA_FUSE=0 (every op
as its own kernels, as before issue #43's fusions; the same logits) and prints both and the speedup;
--untiled likewise with OPTIML_CUDA_TILES=0 (prompts' products by the decode kernels, 8 tokens a pass,
instead of the tensor-core tiles of matmul_tiles.cu); --batch-kernels with OPTIML_CUDA_ONE_TOKEN=0 (batch-1
decode by the kernels built for batches, as before the one-token kernels). --depth D adds decode at depth D (tg after a prompt of D
tokens, llama-bench -d D): OptiML as it chooses (the attention split over the positions for one sequence
over a long cache) and with OPTIML_CUDA_ATTN_SPLITS=1 (unsplit), beside llama.cpp.
tools/checks/gpu_check.sh runs this on every model it has.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import harness
import optiml
from optiml import Batch

PEAK_BYTES_S = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12,
                "A100-SXM4-40GB": 1.56e12, "A100-PCIE-40GB": 1.56e12, "L40S": 0.864e12, "RTX 4090": 1.008e12}


def peak_bandwidth() -> tuple[float, str]:
    name = optiml.system_info()["cuda_devices"][0]["name"]
    for key, bw in PEAK_BYTES_S.items():
        if key in name:
            return bw, f"{name} (spec)"
    try:  # measured: a large device-to-device copy, bytes read and written
        import torch

        a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        b.copy_(a)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize()
        return 2 * 10 * a.numel() / (time.perf_counter() - t), f"{name} (measured copy)"
    except Exception as e:  # noqa: BLE001 - a figure is still printed, marked unknown
        return float("nan"), f"{name} (peak unknown: {e})"


def ours(path: str, tg: int, pp: int, reps: int, launches: int = 0) -> dict:
    out = {"tg": [], "b8": [], "pp": []}
    counted = {}
    with optiml.Model(path, n_ctx=max(pp, tg, 8 * launches) + 64, n_seq=8, device="cuda") as m:
        plan = m.plan
        weight_bytes = plan.device_bytes["attention_weights"] + plan.device_bytes["ffn_weights"]
        prompt = [m.tokenizer.bos_id if m.tokenizer.bos_id >= 0 else 1] + [100 + i % 1000 for i in range(pp - 1)]
        m.eval(prompt)  # (the first prompt grows the scratch buffers: not timed)
        for _ in range(reps):
            m.reset()
            t = time.perf_counter()
            m.eval(prompt)
            out["pp"].append(pp / (time.perf_counter() - t))
            m.reset()
            m.eval(prompt[:8])
            t = time.perf_counter()
            for i in range(tg):
                m.eval([200 + i])
            out["tg"].append(tg / (time.perf_counter() - t))
            m.kv_clear()
            b = Batch()
            for s in range(8):
                b.add_sequence(prompt[:8], s, 0, logits="last")
            m.decode(b)
            steps = max(16, tg // 4)
            t = time.perf_counter()
            for i in range(steps):
                b = Batch()
                for s in range(8):
                    b.add(300 + i, s, 8 + i, logits=True)
                m.decode(b)
            out["b8"].append(8 * steps / (time.perf_counter() - t))
        if launches:
            counted = {"b1": m.launches(launches), "b8": m.launches(launches, batch=8)}
    return {k: statistics.median(v) for k, v in out.items()} | {"weight_bytes": weight_bytes, "launches": counted}


def ours_at_depth(path: str, depth: int, tg: int, reps: int) -> float:
    """Decode tokens/s of one sequence after a prompt of `depth` tokens (median of reps)."""
    out = []
    with optiml.Model(path, n_ctx=depth + tg + 64, device="cuda") as m:
        prompt = [m.tokenizer.bos_id if m.tokenizer.bos_id >= 0 else 1] + [100 + i % 1000 for i in range(depth - 1)]
        for _ in range(reps):
            m.reset()
            m.eval(prompt)
            m.eval([200])  # (the first step of its shape is not timed)
            t = time.perf_counter()
            for i in range(tg):
                m.eval([201 + i])
            out.append(tg / (time.perf_counter() - t))
    return statistics.median(out)


def llama_at_depth(path: str, bench: str | None, depth: int, tg: int, reps: int) -> float:
    if not bench:
        return float("nan")
    res = subprocess.run([bench, "-m", path, "-ngl", "99", "-p", "0", "-n", str(tg), "-d", str(depth), "-r", str(reps),
                          "-o", "json"], capture_output=True, text=True)
    if res.returncode != 0:
        print(f"  llama-bench -d failed: {res.stderr[-500:]}")
        return float("nan")
    return json.loads(res.stdout)[0]["avg_ts"]


def llama(path: str, bench: str | None, batched: str | None, tg: int, pp: int, reps: int) -> dict:
    r = {}
    if bench:
        res = subprocess.run([bench, "-m", path, "-ngl", "99", "-p", str(pp), "-n", str(tg), "-r", str(reps), "-o", "json"],
                             capture_output=True, text=True)
        if res.returncode == 0:
            for row in json.loads(res.stdout):
                r["pp" if row.get("n_prompt") else "tg"] = row["avg_ts"]
        else:
            print(f"  llama-bench failed: {res.stderr[-500:]}")
    if batched:
        res = subprocess.run([batched, "-m", path, "-ngl", "99", "-c", str(8 * (tg + 64)), "-npp", "8", "-ntg",
                              str(max(16, tg // 4)), "-npl", "8", "--output-format", "jsonl"], capture_output=True, text=True)
        rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
        if rows:
            r["b8"] = rows[-1].get("speed_tg", float("nan"))
        else:
            print(f"  llama-batched-bench failed: {res.stderr[-500:]}")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--llama-bench")
    ap.add_argument("--llama-batched-bench")
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--launches", type=int, default=4, metavar="N",
                    help="then count what N decode steps launch (batch 1 and 8) and print it (0: off)")
    ap.add_argument("--unfused", action="store_true",
                    help="also measure OptiML with OPTIML_CUDA_FUSE=0 (its kernels unfused) and print the speedup")
    ap.add_argument("--depth", type=int, default=0, metavar="D",
                    help="also decode at depth D (after a D-token prompt), split attention and unsplit (0: off)")
    ap.add_argument("--untiled", action="store_true",
                    help="also measure OptiML with OPTIML_CUDA_TILES=0 (no tensor-core tiles) and print the speedup")
    ap.add_argument("--batch-kernels", action="store_true",
                    help="also measure OptiML with OPTIML_CUDA_ONE_TOKEN=0 (batch-1 decode by the kernels built for "
                         "batches) and print the speedup")
    args, res = harness.parse(ap, "gpu")
    if not optiml.system_info()["cuda_devices"]:
        print("no CUDA device: nothing to measure")
        return 1
    peak, peak_src = peak_bandwidth()
    print(f"GPU: {peak_src}, peak {peak / 1e9:.0f} GB/s")
    print("| model | test | optiml tok/s | llama.cpp tok/s | ratio | bandwidth used |")
    print("|---|---|---|---|---|---|")
    counts = []
    for path in args.model:
        name = os.path.basename(path)
        try:
            o = ours(path, args.tg, args.pp, args.reps, args.launches)
        except optiml.OptimlError as e:
            print(f"| {name} | - | failed: {e} | | | |")
            continue
        ll = llama(path, args.llama_bench, args.llama_batched_bench, args.tg, args.pp, args.reps)
        for test, label in (("tg", f"tg{args.tg}"), ("b8", "8 seqs"), ("pp", f"pp{args.pp}")):
            theirs = ll.get(test, float("nan"))
            bw = f"{o['weight_bytes'] * o['tg'] / peak:.0%}" if test == "tg" else ""
            if test == "tg" and o["launches"]:  # every byte the step's kernels move, as counted
                t = o["launches"]["b1"].per_token()
                moved = t["weight_bytes"] + t["activation_bytes"] + t["kv_bytes"]
                bw += f" ({moved * o['tg'] / peak:.0%} counted, {t['kernels']:.0f} kernels/token)"
            print(f"| {name} | {label} | {o[test]:.1f} | {theirs:.1f} | {o[test] / theirs:.2f}x | {bw} |", flush=True)
            res.add(model=name, test=label, optiml=o[test], llama_cpp=theirs, ratio=o[test] / theirs, bandwidth_used=bw)
        variants = [("unfused", "OPTIML_CUDA_FUSE", "fused")] if args.unfused else []
        variants += [("untiled", "OPTIML_CUDA_TILES", "tiles")] if args.untiled else []
        variants += [("batch kernels", "OPTIML_CUDA_ONE_TOKEN", "one-token kernels")] if args.batch_kernels else []
        for variant, env, ours_label in variants:
            os.environ[env] = "0"  # (read when the CUDA backend is made)
            try:
                u = ours(path, args.tg, args.pp, args.reps, args.launches)
            finally:
                del os.environ[env]
            for test, label in (("tg", f"tg{args.tg}"), ("b8", "8 seqs"), ("pp", f"pp{args.pp}")):
                theirs = ll.get(test, float("nan"))
                speedup = f"{ours_label} {o[test] / u[test]:.2f}x faster"
                print(f"| {name} | {label} {variant} | {u[test]:.1f} | {theirs:.1f} | {u[test] / theirs:.2f}x | {speedup} |",
                      flush=True)
                res.add(model=name, test=f"{label} {variant}", optiml=u[test], llama_cpp=theirs, ratio=u[test] / theirs,
                        **{f"{ours_label}_speedup": o[test] / u[test]})
            if u["launches"] and o["launches"]:
                print(f"kernels per token, batch 1: {u['launches']['b1'].per_token()['kernels']:.0f} {variant}, "
                      f"{o['launches']['b1'].per_token()['kernels']:.0f} {ours_label}")
        if args.depth:
            theirs = llama_at_depth(path, args.llama_bench, args.depth, args.tg, args.reps)
            split = ours_at_depth(path, args.depth, args.tg, args.reps)
            os.environ["OPTIML_CUDA_ATTN_SPLITS"] = "1"  # (read when the CUDA backend is made)
            try:
                unsplit = ours_at_depth(path, args.depth, args.tg, args.reps)
            finally:
                del os.environ["OPTIML_CUDA_ATTN_SPLITS"]
            label = f"tg{args.tg} @ {args.depth}"
            for variant, v in (("", split), (" unsplit", unsplit)):
                note = f"split {split / unsplit:.2f}x faster" if not variant else ""
                print(f"| {name} | {label}{variant} | {v:.1f} | {theirs:.1f} | {v / theirs:.2f}x | {note} |", flush=True)
                res.add(model=name, test=label + variant, optiml=v, llama_cpp=theirs, ratio=v / theirs)
        if o["launches"]:
            counts.append((name, o["launches"]))
            res.add(model=name, test="launches", **{k: v.to_dict() for k, v in o["launches"].items()})
    for name, c in counts:
        print(f"\n{name}, batch 1: {c['b1']}\n{name}, batch 8: {str(c['b8']).splitlines()[1]}")
    res.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
