#!/usr/bin/env python3
"""Time and peak memory of `optiml convert` on the SmolLM2-135M-Instruct f32 checkpoint, to q8_0 and
q4_k_m, and our q4_k_m's size against llama.cpp's (llama-quantize via llama-cpp-python, from the same
weights as an f32 GGUF).

The f32 checkpoint is made once from the reference Q4_1 GGUF (transformers dequantizes it; needs torch,
transformers, accelerate) into --hf-dir. Each conversion runs in a fresh process so its peak RSS is
its own; the baseline is that of a process that only imports optiml.

    python tools/fetch_models.py smollm2-135m-instruct-q4_1
    python tools/bench/convert.py [--types q8_0 q4_k_m] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

CACHE = harness.internal("models").cache_dir()

# Runs in the child: convert, then report wall time and this process's peak RSS. VmHWM, not getrusage's
# ru_maxrss: that one keeps the parent's peak across exec when the parent's was larger, so on a first run
# (the f32 checkpoint made in this process, 1.1 GiB) every child reported the parent's figure.
CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import optiml
if sys.argv[4] != "0":
    optiml.set_num_threads(int(sys.argv[4]))
from optiml.convert import convert
t1 = time.perf_counter()
if sys.argv[3] != "none":
    convert(sys.argv[1], sys.argv[2], type=sys.argv[3])
t2 = time.perf_counter()
try:
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
except (OSError, StopIteration):  # no /proc (macOS): ru_maxrss, which may include the parent's peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
print(json.dumps({"seconds": t2 - t1, "peak_rss": peak}))
"""


def make_checkpoint(hf_dir: Path) -> None:
    try:
        import torch
        import transformers
    except ImportError:
        sys.exit(f"making the f32 checkpoint {hf_dir} needs torch and transformers (and accelerate): "
                 "pip install torch transformers accelerate")

    gguf_file = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf_file.is_file():
        sys.exit(f"{gguf_file} missing: python tools/fetch_models.py smollm2-135m-instruct-q4_1")
    print(f"making the f32 checkpoint {hf_dir} from {gguf_file.name} ...", file=sys.stderr)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(CACHE), gguf_file=gguf_file.name, dtype=torch.float32)
    m.hf_quantizer = None
    if hasattr(m.config, "quantization_config"):
        del m.config.quantization_config
    m.save_pretrained(hf_dir)
    transformers.AutoTokenizer.from_pretrained(str(CACHE), gguf_file=gguf_file.name).save_pretrained(hf_dir)


def run_child(hf_dir: Path, out: Path, qtype: str, threads: int) -> dict:
    import optiml  # the child imports the same optiml (installed, or the in-place dev build)

    here = str(Path(optiml.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", CHILD, str(hf_dir), str(out), qtype, str(threads)],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_cpp_size(f32_gguf: Path, out: Path, ftype: int, threads: int) -> int | None:
    import ctypes

    llama_cpp = harness.llama_cpp(required=False)  # optional here: without it the column stays empty
    if llama_cpp is None:
        return None
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, threads or 2
    saved = os.dup(2)  # llama.cpp logs every tensor to stderr
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        rc = llama_cpp.llama_model_quantize(str(f32_gguf).encode(), str(out).encode(), ctypes.byref(p))
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    return out.stat().st_size if rc == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", type=Path, default=CACHE / "SmolLM2-135M-Instruct-f32-hf")
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_k_m"])
    ap.add_argument("-t", "--threads", type=int, default=0, help="quantization threads (0 = optiml's default)")
    args, res = harness.parse(ap, "convert")
    if not (args.hf_dir / "model.safetensors").is_file():
        make_checkpoint(args.hf_dir)

    src = sum(f.stat().st_size for f in args.hf_dir.glob("*.safetensors"))
    print(f"checkpoint: {args.hf_dir} ({src / 2**20:.0f} MiB of safetensors); largest tensor: token_embd "
          f"49152 x 576 f32 = {49152 * 576 * 4 / 2**20:.0f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = run_child(args.hf_dir, tmp / "none", "none", args.threads)
        print(f"baseline (python + import optiml.convert): peak RSS {base['peak_rss'] / 2**20:.0f} MiB")
        print("| type   | seconds | peak RSS MiB | over baseline | output MiB | llama.cpp MiB | ratio |")
        print("|--------|---------|--------------|---------------|------------|---------------|-------|")
        f32 = None
        for qtype in args.types:
            out = tmp / f"{qtype}.gguf"
            best = min((run_child(args.hf_dir, out, qtype, args.threads) for _ in range(2)), key=lambda r: r["seconds"])
            size = out.stat().st_size
            theirs = ""
            ratio = ""
            if qtype in ("q4_k_m", "q5_k_m", "q6_k", "q4_0", "q8_0"):
                TYPES = harness.internal("quant_mix").TYPES
                if f32 is None:
                    f32 = tmp / "f32.gguf"
                    run_child(args.hf_dir, f32, "f32", args.threads)
                ls = llama_cpp_size(f32, tmp / f"llama.cpp.{qtype}.gguf", int(TYPES[qtype].ftype), args.threads)
                if ls:
                    theirs, ratio = f"{ls / 2**20:.1f}", f"{size / ls:.4f}"
            res.add(type=qtype, seconds=best["seconds"], peak_rss_mib=best["peak_rss"] / 2**20,
                    over_baseline_mib=(best["peak_rss"] - base["peak_rss"]) / 2**20, output_mib=size / 2**20,
                    llama_cpp_mib=float(theirs) if theirs else None, ratio=float(ratio) if ratio else None)
            print(f"| {qtype:6s} | {best['seconds']:7.2f} | {best['peak_rss'] / 2**20:12.0f} | "
                  f"{(best['peak_rss'] - base['peak_rss']) / 2**20:13.0f} | {size / 2**20:10.1f} | {theirs:>13s} | "
                  f"{ratio:>5s} |")
    res.write(args.json)


if __name__ == "__main__":
    main()
