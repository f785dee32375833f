#!/usr/bin/env python3
"""CPU attention offload against GPU-only serving at the same device KV memory (issue #19's benchmark).

    python tools/bench/offload.py -m llama7b-q4_0.gguf --device cuda --offered 16 --kv-share 0.25 \
        --llama-server build/llama-cuda/bin/llama-server
    python tools/bench/offload.py -m SmolLM2.gguf --device cpu:1 --offered 4 --gen 16   # the pipeline, no GPU

--offered clients each stream --requests completions of --gen tokens (end of text banned, so every
request has the same length) at once. The device's KV memory holds --kv-share of them (at --ctx
positions each). Three servers, one after the other, with that memory:
    gpu-only       optiml serve --parallel K: K = the sequences the KV memory holds; the rest queue
    pipelined      optiml serve --parallel N --kv-vram (K sequences' bytes): the others start with their KV
                   cache in host memory and their attention on the CPU when the policy finds it pays
    llama-server   -np K -c K*ctx -ngl 99: the same KV memory, every layer on the device
Each row: aggregate generated tokens/s, time to first token p50/p99, inter-token latency p99. The goal
(issue #19): pipelined >= 1.5x gpu-only throughput at the same p99 inter-token latency, with the KV
memory for a quarter of the offered sequences; with ample KV memory (--kv-share 1) never slower.
"""

from __future__ import annotations

import argparse
import os
import sys

import harness
import optiml
from serving import PROMPT, free_port, run_level, start_server, stop_server, wait_ready

oplan = harness.internal("plan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    ap.add_argument("--offered", type=int, default=16, help="concurrent clients")
    ap.add_argument("--kv-share", type=float, default=0.25, help="share of the offered sequences the device KV holds")
    ap.add_argument("--requests", type=int, default=1, help="requests per client")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--ctx", type=int, default=1024, help="context per sequence")
    ap.add_argument("--max-itl-ms", type=float, default=None, help="the pipelined server's latency bound")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (CUDA build) to compare with")
    args, res = harness.parse(ap, "offload")
    args.model = harness.model_path(args.model, pull=True)

    hp = oplan.make(args.model, n_ctx=args.ctx, n_seq=1, device=args.device, n_gpu_layers=0)
    n_layer = len(hp.layers)
    per_seq = oplan.make(args.model, n_ctx=args.ctx, n_seq=1, device=args.device,
                               n_gpu_layers=n_layer).device_bytes["kv"]
    cap = max(1, min(args.offered, round(args.offered * args.kv_share)))
    kv_vram = cap * per_seq
    print(f"model {os.path.basename(args.model)}; device {args.device}; {args.offered} clients x {args.requests} "
          f"request(s) of {args.gen} tokens; device KV for {cap} sequence(s) of {args.ctx} positions "
          f"({kv_vram / 2**20:.0f} MiB)", flush=True)

    tok = optiml.tokenizer.load(args.model)
    body = {"prompt": PROMPT, "max_tokens": args.gen, "temperature": 0, "stream": True,
            "logit_bias": {str(t): -100 for t in tok.eog_ids}}
    threads = [] if args.threads is None else ["-t", str(args.threads)]
    serve = [sys.executable, "-m", "optiml", "serve", "-m", args.model, "--device", args.device, "--ctx",
             str(args.ctx), "-ngl", str(n_layer), "--queue", str(args.offered * args.requests), *threads]
    servers = {
        "gpu-only": serve + ["--parallel", str(cap)],
        "pipelined": serve + ["--parallel", str(args.offered), "--kv-vram", str(kv_vram)]
        + ([] if args.max_itl_ms is None else ["--max-itl-ms", str(args.max_itl_ms)]),
    }
    if args.llama_server:
        servers["llama-server"] = [args.llama_server, "-m", args.model, "-np", str(cap), "-c", str(cap * args.ctx),
                                   "-ngl", "99", "--cont-batching", *threads]
    rows, failed = {}, []
    print(f"\n{'server':13} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p99':>8}", flush=True)
    for name, cmd in servers.items():
        port = free_port()
        proc = start_server(cmd + ["--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc)
            run_level(url, 1, 1, dict(body, max_tokens=4))  # warm up
            r = rows[name] = run_level(url, args.offered, args.requests, body)
            res.add(server=name, clients=args.offered, device_kv_sequences=cap, **r)
            print(f"{name:13} {r['tok_s']:8.1f} {r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p99'] * 1e3:7.0f}ms "
                  f"{r['itl_p99'] * 1e3:6.0f}ms", flush=True)
        except SystemExit as e:  # (the server's log is in the message): the other servers are still measured
            failed.append(name)
            print(f"{name:13} failed: {e}", file=sys.stderr, flush=True)
            res.note(f"{name} failed: {str(e).splitlines()[0]}")
        finally:
            stop_server(proc)
    p, g = rows.get("pipelined"), rows.get("gpu-only")
    if p and g:
        print(f"\npipelined / gpu-only: throughput {p['tok_s'] / g['tok_s']:.2f}x (goal >= 1.5x at a quarter; never "
              f"below 1.0x with ample KV), ITL p99 {p['itl_p99'] * 1e3:.0f} vs {g['itl_p99'] * 1e3:.0f} ms")
    if p and "llama-server" in rows:
        print(f"pipelined / llama-server: throughput {p['tok_s'] / rows['llama-server']['tok_s']:.2f}x")
    res.write(args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
