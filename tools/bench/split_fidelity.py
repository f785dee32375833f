#!/usr/bin/env python3
"""How far a device split moves a model's output (issue 44, item 4): mean KL divergence of every scored
position's next-token distribution, each split run against the CPU-only run of the same file, over windows
of the shared text (llama.cpp's perplexity windows). The second device is `cpu:1` (another CPU instance
that the plan treats as an accelerator) unless --device says otherwise (cuda on a GPU machine).

Splits: every FFN split at 512 neurons, uneven shares (0, 256, ... per layer), a VRAM budget that the plan
fills (whole layers, then split ones), and whole layers. The goal is KLD <= 5e-4; a dense split on a CPU
device gives the CPU run's bits (KLD 0: the host finishes the FFN as one device would), a sparse one adds
the two shares' partial down sums.

    PYTHONPATH=python python tools/bench/split_fidelity.py smollm2-135m-instruct-q4_1 gemma3-270m-q4_k_m

--simd-spread adds rows for the CPU itself at each other SIMD level this machine has (OPTIML_SIMD, in a child
process: the level is read when the module loads) against its default level: the spread of the CPU's own
runs, which differ only in the order of float sums. That is the floor a device can be held to: 8-bit
activations turn a last-bit difference into a whole quantization step now and then, and small models carry
it to the logits.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

import harness
import optiml

px = harness.internal("perplexity")
GOAL = 5e-4


def splits(n_layer: int) -> dict:
    return {"gpu_neurons=512": dict(gpu_neurons=512),
            "uneven shares": dict(gpu_neurons=[256 * (i % 5) for i in range(n_layer)]),
            "vram=20MiB": dict(vram="20MiB"),
            "n_gpu_layers=2": dict(n_gpu_layers=2)}


def logp(path: str, ws: list, n_ctx: int, threads: int, **kw) -> tuple[np.ndarray, dict]:
    with optiml.Model(path, n_ctx=n_ctx, n_threads=threads, **kw) as m:
        rows = [px.scored_logp(m, w)[0] for w in ws]
        return np.vstack(rows), {"sparsity": m.sparsity, "ffn_on_device": [l["ffn_on_device"] for l in m.plan.layers]}


def simd_runs(name: str, ctx: int, chunks: int, threads: int, extra: dict) -> dict:
    """{level: log-probabilities of the CPU-only run at that SIMD level} for each level but the default one."""
    out = {}
    levels = [lv for lv in optiml._core.simd_levels() if lv != optiml.system_info()["simd"]]
    for level in levels:
        with tempfile.TemporaryDirectory() as tmp:
            dump = os.path.join(tmp, "logp.npy")
            cmd = [sys.executable, __file__, name, "--ctx", str(ctx), "--chunks", str(chunks), "--threads", str(threads),
                   "--dump", dump] + (["--sparsity", extra["sparsity"]] if extra else [])
            r = subprocess.run(cmd, env=dict(os.environ, OPTIML_SIMD=level), capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"the CPU run at OPTIML_SIMD={level} failed:\n{r.stderr}")
            out[level] = np.load(dump)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="model names (tools/fetch_models.py) or GGUF paths")
    ap.add_argument("--device", default="cpu:1")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8, help="windows of the text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sparsity", default=None, help="the runs' sparsity (default: the model's own choice)")
    ap.add_argument("--simd-spread", action="store_true",
                    help="also the CPU at its other SIMD levels against its default one (the floor a device can meet)")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # (a child of --simd-spread: the CPU run's log-probabilities)
    a, res = harness.parse(ap, "split_fidelity")
    text = harness.TEXT.read_text()
    extra = {} if a.sparsity is None else {"sparsity": a.sparsity}
    for name in harness.existing_models(a.models):
        with optiml.Model(name, n_ctx=a.ctx) as m:
            ws = px.windows(m, text, a.ctx, a.chunks)
            n_layer = len(m.plan.layers)
        base, _ = logp(name, ws, a.ctx, a.threads, device="cpu", **extra)
        if a.dump:
            np.save(a.dump, base)
            return 0
        runs = [(label, dict(device=a.device, **kw)) for label, kw in splits(n_layer).items()]
        spread = simd_runs(name, a.ctx, a.chunks, a.threads, extra) if a.simd_spread else {}
        for label, kw in runs + [(f"CPU at OPTIML_SIMD={level}", None) for level in spread]:
            if kw is None:
                got, info = spread[label.rsplit("=", 1)[1]], {"sparsity": "", "ffn_on_device": "none: the CPU alone"}
            else:
                got, info = logp(name, ws, a.ctx, a.threads, **kw, **extra)
            row = res.add(model=name.rsplit("/", 1)[-1], split=label, sparsity=info["sparsity"],
                          kld=float((np.exp(base) * (base - got)).sum(axis=1).mean()),
                          same_top=float((base.argmax(1) == got.argmax(1)).mean()),
                          bit_exact=bool(np.array_equal(base, got)))
            harness.log(f"{row}  (neurons on {a.device} per layer: {info['ffn_on_device']})")
    worst = max(r["kld"] for r in res.rows if not r["split"].startswith("CPU at"))
    res.note(f"{a.device} against the CPU alone, {a.chunks} windows of {a.ctx} tokens, mean KLD per scored position; "
             f"worst {worst:.2e}, goal <= {GOAL:.0e}: {'met' if worst <= GOAL else 'NOT met'}")
    print(harness.machine_line())
    print(res.table(formats={"kld": ".2e", "same_top": ".1%"}))
    print("\n".join(res.notes))
    res.write(a.json)
    return 0 if worst <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
