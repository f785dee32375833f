#!/usr/bin/env python3
"""Mixtures of experts split between a device and the CPU, against llama.cpp's --n-cpu-moe at the same device
memory (issue #46, item 7, the GPU half).

    python tools/bench/moe_gpu.py --device cuda --n-layer 8 --share 0.25 --llama-bench build/llama-cuda/bin/llama-bench
    python tools/bench/moe_gpu.py --device cpu:1 --n-layer 2      # our side of the pipeline, no GPU needed

The model is tools/bench/moe.py's Qwen3-30B-A3B shape (128 experts of 768, 8 used, Q4_K, planted expert
popularity) with --n-layer layers. llama.cpp runs it as its users run such models on a small GPU: -ngl 99
-ncmoe N, everything but the experts of the first N layers on the GPU, N = round(n_layer * (1 - share)).
The budget is what that puts on the device, counted from the file (the non-expert weights but the token
embeddings, the experts of the other layers, the f16 KV cache for --ctx; llama.cpp's compute buffers not
counted: it gets the benefit of the doubt). Then the real tools on our side: `optiml profile` (the router's
choices on text), `optiml solve` within that budget (the hottest experts of every layer), and:

    ours, placed      the solver's placement on the device, vram = the budget
    ours, -ncmoe N    llama.cpp's placement on our engine (whole layers' experts)
    ours, CPU only
    llama.cpp         llama-bench -ngl 99 -ncmoe N, and -ngl 0

Decode: tokens/s of --tokens steps after a short prompt (llama-bench's tg); prompt: --prompt tokens in one
step (pp). Goal (issue #46): decode >= 1.5x llama.cpp at the same memory, with a quarter of the experts there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import harness

import optiml
from moe import make_model
from optiml.offline.solve_experts import expert_layout

GOAL = 1.5


def sh(cmd: list) -> None:
    print("+ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def optiml_cmd(*args) -> list:
    return [sys.executable, "-m", "optiml", *args]


def budget_for(path: str, n_cpu_moe: int, ctx: int) -> int:
    """Device bytes of llama.cpp's -ngl 99 -ncmoe n_cpu_moe, from the file (no compute buffers)."""
    lay = expert_layout(path)
    L, X = lay["n_layer"], lay["n_expert"]
    experts = sum(lay["expert_bytes"][l] * X for l in range(n_cpu_moe, L))
    return lay["weights_fixed"] + lay["kv_per_token"] * ctx + experts


def speeds(m: optiml.Model, ids: list, n_gen: int, n_prompt: int, reps: int) -> tuple[float, float]:
    """Median decode and prompt tokens/s (a warm-up run first)."""
    tg, pp = [], []
    for r in range(reps + 1):
        m.reset()
        m.eval(ids[:16])
        t0 = time.perf_counter()
        for t in ids[16:16 + n_gen]:
            m.eval([t])
        if r:
            tg.append(n_gen / (time.perf_counter() - t0))
        m.reset()
        t0 = time.perf_counter()
        m.eval(ids[:n_prompt])
        if r:
            pp.append(n_prompt / (time.perf_counter() - t0))
    m.reset()
    return statistics.median(tg), statistics.median(pp)


def llama_bench(binary: str, path: str, n_cpu_moe: int, ngl: int, n_gen: int, n_prompt: int, reps: int,
                threads: int) -> tuple[float, float]:
    cmd = [binary, "-m", path, "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps), "-ngl", str(ngl),
           "-t", str(threads), "-o", "json"]
    if n_cpu_moe:
        cmd += ["-ncmoe", str(n_cpu_moe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    rows = json.loads(r.stdout)
    tg = next(float(x["avg_ts"]) for x in rows if x["n_gen"] > 0)
    pp = next(float(x["avg_ts"]) for x in rows if x["n_prompt"] > 0)
    return tg, pp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda[:N], or cpu:1 to run our side without a GPU")
    ap.add_argument("--n-layer", type=harness.positive, default=8, help="layers of the model (Qwen3-30B-A3B has 48)")
    ap.add_argument("--share", type=float, default=0.25, help="share of the layers whose experts llama.cpp puts "
                    "on the device (the budget follows)")
    ap.add_argument("--tokens", type=harness.positive, default=32, help="decode steps")
    ap.add_argument("--prompt", type=harness.positive, default=512, help="prompt tokens")
    ap.add_argument("--reps", type=harness.positive, default=2)
    ap.add_argument("--ctx", type=harness.positive, default=1024)
    ap.add_argument("-t", "--threads", type=harness.positive, default=optiml._core.physical_core_count())
    ap.add_argument("--profile-tokens", type=int, default=2048)
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (its CUDA build for --device cuda)")
    ap.add_argument("--workdir", default=str(harness.BUILD / "bench-moe-gpu"))
    ap.add_argument("--tokenizer-from", default=None, help="donor GGUF for the synthetic model's tokenizer "
                    "(make_synthetic_model.py's default: SmolLM2 in the model cache)")
    args, res = harness.parse(ap, "moe_gpu")
    harness.check_device(ap, args.device)  # before minutes of writing the synthetic model
    if args.llama_bench and not shutil.which(args.llama_bench):
        ap.error(f"--llama-bench {args.llama_bench}: no such program (give the path of a llama-bench binary)")
    if not 0 <= args.share <= 1:
        ap.error(f"--share is a share of the layers: in [0, 1], not {args.share}")
    os.makedirs(args.workdir, exist_ok=True)
    model = os.path.join(args.workdir, f"qwen3moe-30b-a3b-shape-{args.n_layer}l-q4_k.gguf")
    if not os.path.exists(model):
        make_model(model, args.n_layer, 1.0, args.tokenizer_from)
    stats = os.path.join(args.workdir, f"{os.path.basename(model)[:-5]}.stats.npz")
    if not os.path.exists(stats):
        sh(optiml_cmd("profile", "-m", model, "--data", harness.TEXT, "--tokens", args.profile_tokens, "--samples",
                      "0", "-o", stats, "-t", args.threads, "-q"))
    n_cpu_moe = round(args.n_layer * (1 - args.share))
    budget = budget_for(model, n_cpu_moe, args.ctx)
    placed = os.path.join(args.workdir, f"{os.path.basename(model)[:-5]}.placed-ncmoe{n_cpu_moe}-ctx{args.ctx}.gguf")
    if not os.path.exists(placed):
        sh(optiml_cmd("solve", "-m", model, "--stats", stats, "--vram", budget, "--ctx", args.ctx, "-o", placed))
    print(f"\n{os.path.basename(model)}: {args.n_layer} layers; budget {budget / 2**20:.1f} MiB = llama.cpp -ngl 99 "
          f"-ncmoe {n_cpu_moe} (the experts of {args.n_layer - n_cpu_moe} of {args.n_layer} layers on the device); "
          f"{args.threads} CPU threads, device {args.device}", flush=True)
    with optiml.Model(model, n_ctx=32) as m:
        ids = [(i * 7919) % (m.n_vocab - 300) + 300 for i in range(max(args.prompt, 16 + args.tokens))]

    ours = {}

    def run(label, path, **kw):
        with optiml.Model(path, n_ctx=args.ctx, n_threads=args.threads, n_batch=512, **kw) as m:
            used = m.plan.device_bytes["total"] if m.plan.device != "cpu" else 0
            experts = sum(len(l["device_experts"]) for l in m.plan.layers)
            tg, pp = speeds(m, ids, args.tokens, args.prompt, args.reps)
        ours[label] = (tg, pp)
        res.add(run=label, device_mib=used / 2**20, decode_tok_s=tg, prompt_tok_s=pp)
        print(f"  {label:28} device {used / 2**20:8.1f} MiB ({experts} split experts)  decode {tg:8.2f} tok/s  "
              f"prompt {pp:8.1f} tok/s", flush=True)

    run("ours, placed", placed, device=args.device, vram=budget)
    run(f"ours, -ncmoe {n_cpu_moe}", model, device=args.device, n_cpu_moe=n_cpu_moe)
    run("ours, CPU only", model, device="cpu")
    theirs, peer_failed = {}, None
    if args.llama_bench:
        try:
            for label, ngl, nc in ((f"llama.cpp -ngl 99 -ncmoe {n_cpu_moe}", 99, n_cpu_moe), ("llama.cpp -ngl 0", 0, 0)):
                tg, pp = llama_bench(args.llama_bench, model, nc, ngl, args.tokens, args.prompt, args.reps,
                                     args.threads)
                theirs[label] = (tg, pp)
                res.add(run=label, decode_tok_s=tg, prompt_tok_s=pp)
                print(f"  {label:28} {'':36}decode {tg:8.2f} tok/s  prompt {pp:8.1f} tok/s", flush=True)
        except SystemExit as e:  # our rows and the JSON still stand; the run fails with why
            peer_failed = str(e)
            print(peer_failed, file=sys.stderr)
            res.note(f"llama.cpp failed: {peer_failed.splitlines()[0]}")
        peer = theirs.get(f"llama.cpp -ngl 99 -ncmoe {n_cpu_moe}")
        mine = ours["ours, placed"]
        if peer:
            print(f"\nours placed / llama.cpp -ncmoe {n_cpu_moe} at the same memory: decode {mine[0] / peer[0]:.2f}x "
                  f"(goal {GOAL}x), prompt {mine[1] / peer[1]:.2f}x")
    res.write(args.json)
    return 1 if peer_failed else 0


if __name__ == "__main__":
    sys.exit(main())
