"""The `optiml` command: chat, pull, run, bench, perplexity, tokenize, info, convert, solve, system.

    optiml chat                                   # talk to smollm2-135m-instruct (pulled on first use)
    optiml pull gemma3-270m                       # fetch a known model into the cache
    optiml pull org/repo:Q4_K_M                   # or a GGUF from the Hugging Face Hub (org/repo/FILE.gguf too)
    optiml run -m MODEL.gguf -p "The capital of France is" -n 32
    optiml bench -m MODEL.gguf -t 2
    optiml perplexity -m MODEL.gguf -f text.txt --ctx 256
    optiml perplexity -m BASE.gguf -f text.txt --ctx 256 --kl-divergence-base base.kld    # save the base
    optiml perplexity -m OTHER.gguf --kl-divergence-base base.kld --kl-divergence        # KLD against it
    optiml tokenize -m MODEL.gguf -p "Hello world"
    optiml info MODEL.gguf [--plot curves.png] [--stats STATS.npz]
    optiml convert HF_DIR -o OUT.gguf --type q4_k_m
    optiml solve -m MODEL.gguf --stats STATS.npz --vram 6GiB -o PLACED.gguf
    optiml serve -m MODEL.gguf --parallel 4 --ctx 4096      # OpenAI-compatible API on 127.0.0.1:8080

Output for scripts: results on stdout, progress and logs on stderr (none with -q/--quiet, before or after
the command); `info`, `bench` and `perplexity` take --json (one JSON object on stdout). Exit status: 0 done,
2 bad input (arguments, missing files, unknown models), 1 a failure while running.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

import numpy as np

from . import __version__, _core
from ._core import OptimlError
from .util.sizes import mib


MODEL_HELP = ("GGUF model file, a known model name (optiml pull --list) or a Hugging Face reference "
              "(org/repo:Q4_K_M, org/repo/FILE.gguf), pulled on first use")

_quiet = False  # -q/--quiet: no progress or log lines on stderr (set by main)


def _model(name: str) -> str:
    """The one resolver of model arguments: a path stays a path; a known name or a Hugging Face reference
    becomes its cached file. A name that is none of these is bad input (exit status 2)."""
    import os

    from .hub.registry import resolve

    path = resolve(name, quiet=_quiet)
    if not os.path.exists(path):
        raise _core.ArgumentError(f"no such model file: {name} (give a GGUF file, a known model name: optiml pull "
                                  "--list, or a Hugging Face reference: org/repo:QUANT or org/repo/FILE.gguf)")
    return path


def _print_json(obj) -> None:
    """--json: one object on stdout (numpy values as plain numbers and lists)."""
    def plain(o):
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, bytes):
            return o.decode("utf-8", errors="replace")
        raise TypeError(f"{type(o).__name__} is not JSON serializable")

    print(json.dumps(obj, default=plain))


SPARSITY_HELP = ("FFN neuron skipping: auto (the file's calibrated thresholds; exact zero-skipping for ReLU "
                 "models; else dense), threshold (the same, an error when there is nothing to skip by), none")


def _add_model_args(p: argparse.ArgumentParser, ctx_default: int | None = None, required: bool = True) -> None:
    p.add_argument("-m", "--model", required=required, help=MODEL_HELP)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--ctx", type=int, default=ctx_default, help="context length in tokens")
    p.add_argument("--sparsity", choices=("auto", "threshold", "none"), default="auto", help=SPARSITY_HELP)
    p.add_argument("--predictors", default="auto", help=PREDICTORS_HELP)


def _load(args, n_ctx: int | None = None):
    import warnings

    from .engine.model import Model
    from .engine.sparsity import PredictorWarning

    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PredictorWarning)
            return Model(_model(args.model), n_ctx=n_ctx if n_ctx is not None else args.ctx, n_threads=args.threads,
                         sparsity=getattr(args, "sparsity", "auto"), predictors=_predictors(args),
                         use_mmap=_use_mmap(args), **_device(args))
    finally:
        for w in caught:  # a log line, not a Python warning with its source line
            if issubclass(w.category, PredictorWarning):
                if not _quiet:
                    print(f"optiml: {w.message}", file=sys.stderr)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _use_mmap(args):
    """Model's use_mmap from --mmap / --no-mmap (absent: "auto")."""
    v = getattr(args, "mmap", None)
    return "auto" if v is None else v


def _device(args) -> dict:
    """Model's keyword arguments for where layers run (the options of _add_device_args)."""
    return {"device": getattr(args, "device", "auto"), "vram": getattr(args, "vram", None),
            "n_gpu_layers": getattr(args, "n_gpu_layers", None), "gpu_neurons": getattr(args, "gpu_neurons", None)}


PREDICTORS_HELP = ("activation predictors (optiml train-predictors): auto (MODEL.predictors.gguf beside the model "
                   "when present, unless it marks so many neurons active that it would slow decoding down), none, "
                   "or a file")


def _predictors(args):
    p = getattr(args, "predictors", "auto")
    return None if p == "none" else p


# ---- profile, calibrate ---------------------------------------------------------------------------
def cmd_profile(args) -> int:
    from .offline.profile import coverage_of_top, profile

    st = profile(_model(args.model), args.data, n_tokens=args.tokens, out=args.output, n_ctx=args.ctx or 512,
                 threshold=args.threshold, active_share=args.active_share, samples=args.samples, field=args.field,
                 n_threads=args.threads, progress=not args.quiet)
    print(f"profiled {st.n_tokens} tokens of {st.model} ({st.activation}); a neuron fires when "
          f"|act(gate)*up| > threshold (layer mean {float(st.threshold.mean()):.4g})")
    print(f"mean firing rate {float(st.freq.mean()):.3f}; the top 10% of each layer's neurons cover "
          f"{coverage_of_top(st, 0.1):.1%} of firings, the top 20% {coverage_of_top(st, 0.2):.1%}")
    print(f"wrote {args.output}")
    return 0


def cmd_calibrate(args) -> int:
    from .offline.calibrate import calibrate

    cal = calibrate(_model(args.model), args.data, target=args.target, out=args.output, n_tokens=args.tokens,
                    criterion=args.criterion, allocation=args.allocation, n_ctx=args.ctx or 512,
                    n_threads=args.threads, progress=not args.quiet, stats=_load_stats(args.stats))
    print(f"criterion {cal.criterion}, allocation {cal.allocation}, target {cal.target:.0%} of FFN neurons skipped "
          f"(on {cal.n_tokens} calibration tokens)")
    print("layer  skip   threshold")
    for l, (t, sh) in enumerate(zip(cal.threshold, cal.layer_target)):
        print(f"{l:5d}  {sh:5.1%}  {t:.5g}")
    print(f"wrote {args.output}")
    return 0


def _load_stats(path):
    if path is None:
        return None
    from .formats.stats import load

    return load(path)


def cmd_train_predictors(args) -> int:
    from .engine.sparsity import break_even_share
    from .formats.predictors import default_predictor_path
    from .offline.predictors import train_predictors

    model = _model(args.model)
    out = args.output or default_predictor_path(model)
    res = train_predictors(model, args.data, recall=args.recall, out=out, samples=args.samples,
                           label_sparsity=args.label_sparsity, max_rank=args.max_rank, qtype=args.type,
                           seed=args.seed, n_ctx=args.ctx, n_threads=args.threads, progress=not args.quiet,
                           field=args.field)
    print(res.table())
    print(f"recall target {res.recall_target} per layer; mean predicted share {float(res.predicted.mean()):.3f} "
          f"(truly active {float(res.active.mean()):.3f}) on held-out tokens of {res.n_samples} samples; "
          f"{res.seconds.get('samples_s', 0):.0f} s sampling, {res.seconds.get('train_s', 0):.0f} s training")
    print(f"wrote {out}")
    limit = break_even_share(res.activation) if res.activation else None
    if limit is not None and float(res.predicted.mean()) > limit:
        print(f"note: above about {limit:.0%} predicted the sparse FFN is slower than the dense one, so a model "
              "loaded with predictors=auto leaves this file unused (name it with --predictors to use it anyway); "
              "a lower --recall or a sparser --label-sparsity predicts fewer neurons")
    return 0


# ---- run ------------------------------------------------------------------------------------------
def cmd_run(args) -> int:
    m = _load(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    t0 = time.perf_counter()
    for piece in m.stream(
        prompt,
        max_tokens=args.n_predict,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
        stop=args.stop,
    ):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose:
        dt = time.perf_counter() - t0
        print(f"[{m.n_past} tokens in context, {dt:.2f} s]", file=sys.stderr)
    return 0


# ---- bench ----------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from .engine.timing import bench_model

    m = _load(args, n_ctx=max(args.n_prompt, args.n_gen, args.timeline or 0) + 64)
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
    if args.json:
        _print_json({"model": args.model, "path": m.path, "arch": hp["arch"], "weight_bytes": hp["weight_bytes"],
                     "threads": args.threads or _core.get_num_threads(), "simd": _core.system_info()["simd"],
                     "n_prompt": args.n_prompt, "n_gen": args.n_gen, "repetitions": args.repetitions,
                     "pp_tokens_per_s": r["pp"], "tg_tokens_per_s": r["tg"],
                     "pp_runs": r["pp_runs"], "tg_runs": r["tg_runs"]})
        return 0
    print(f"model: {args.model} ({hp['arch']}, {hp['weight_bytes'] / 2**20:.1f} MiB), "
          f"threads: {args.threads or _core.get_num_threads()}, simd: {_core.system_info()['simd']}")
    print(f"| test  | tokens/s (median of {args.repetitions}) |")
    print("|-------|-----------|")
    print(f"| pp{args.n_prompt:<3} | {r['pp']:9.2f} |")
    print(f"| tg{args.n_gen:<3} | {r['tg']:9.2f} |")
    return 0


# ---- perplexity -----------------------------------------------------------------------------------
def cmd_perplexity(args) -> int:
    from .evaluate import perplexity as px

    def progress(i, n, x):  # on stderr: stdout holds only the result
        if not _quiet:
            print(f"[{i}]{x:.4f},", end=" " if i < n else "\n", flush=True, file=sys.stderr)

    log = (lambda *a: None) if _quiet else (lambda *a: print(*a, file=sys.stderr))
    t0 = time.perf_counter()
    if args.kl_divergence:
        if not args.kl_divergence_base:
            raise _core.ArgumentError("--kl-divergence compares against a saved base: give --kl-divergence-base FILE")
        base = px.read_base(args.kl_divergence_base)
        if args.ctx is not None and args.ctx != base.n_ctx:
            raise _core.ArgumentError(f"the base was written with --ctx {base.n_ctx}; leave --ctx out or give "
                                      f"{base.n_ctx}")
        m = _load(args, n_ctx=base.n_ctx)
        if args.file:
            with open(args.file, encoding="utf-8", errors="replace") as f:
                ws = px.windows(m, f.read(), base.n_ctx, base.n_chunks)
            if len(ws) < base.n_chunks or any(w != base.window(i) for i, w in enumerate(ws)):
                raise _core.ArgumentError(f"{args.file} does not tokenize to the base's tokens with this model "
                                          "(the base stores its tokens: -f can be left out)")
        log(f"comparing with {base.path} ({base.model}, {base.n_chunks} windows of {base.n_ctx}); mean KLD:")
        r = px.compare(base, m, args.chunks, progress)
        log(f"{r.n} tokens scored in {time.perf_counter() - t0:.1f} s")
        if args.json:
            _print_json({"model": args.model, "base": str(base.path), "base_model": base.model, "n_ctx": base.n_ctx,
                         "seconds": time.perf_counter() - t0, **r.summary()})
        else:
            print(r.format())
        return 0
    if not args.file:
        raise _core.ArgumentError("give the text with -f FILE")
    m = _load(args, n_ctx=512 if args.ctx is None else args.ctx)
    with open(args.file, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if args.kl_divergence_base:
        ppl, err, count = px.save_base(args.kl_divergence_base, m, text, m.n_ctx, args.chunks, args.kl_top_k, progress)
        log(f"saved the log-probs of {count} tokens to {args.kl_divergence_base}")
    else:
        ppl, err, count = px.perplexity(m, text, m.n_ctx, args.chunks, progress)
    log(f"{count} tokens scored in {time.perf_counter() - t0:.1f} s (n_ctx={m.n_ctx})")
    if args.json:
        _print_json({"model": args.model, "file": args.file, "n_ctx": m.n_ctx, "n_tokens": count, "ppl": ppl,
                     "ppl_err": err, "seconds": time.perf_counter() - t0, "base_written": args.kl_divergence_base})
        return 0
    print(f"PPL = {ppl:.4f} +/- {err:.4f}")
    return 0


# ---- tokenize / info / system ---------------------------------------------------------------------
def cmd_tokenize(args) -> int:
    from .engine.tokenizer import Tokenizer

    tok = Tokenizer.from_file(_model(args.model))
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    ids = tok.encode(text, add_special=not args.no_bos, parse_special=args.special)
    if args.ids:
        print(ids)
    else:
        for i in ids:
            print(f"{i:6d} -> {tok.token_to_piece(i)!r}")
    return 0


def _add_device_args(p, loads_weights: bool = True) -> None:
    if loads_weights:
        p.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=None,
                       help="--mmap maps the model file; --no-mmap reads it into memory (2 MiB pages on Linux: "
                       "faster generation, slower load); default: into memory when the CPU runs every layer, "
                       "transparent huge pages are on and the file fits in half of the available memory")
    p.add_argument("--device", default="auto", help="auto (the CPU), cpu, cuda[:N] (a GPU, in a CUDA build) or "
                   "cpu:1 (a second CPU device treated as one, for testing split execution)")
    p.add_argument("--vram", default=None, help="device memory budget: bytes or a size (6GiB, 512MiB)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None,
                   help="the last N layers whole on the device (as llama.cpp's -ngl)")
    p.add_argument("--gpu-neurons", type=int, default=None,
                   help="FFN neurons per layer on the device (overrides the file's placement)")


def cmd_info(args) -> int:
    from .formats import gguf

    args.model = _model(args.model)
    if args.json:
        if args.plan or args.plot:
            raise _core.ArgumentError("--json prints the file's facts; leave out --plan and --plot")
        _print_json(_info_json(args.model, args.tensors))
        return 0
    if args.plan:  # where each layer would run, without loading the weights
        from .engine import plan

        print(plan.make(args.model, n_ctx=args.ctx, n_seq=args.parallel, device=args.device, vram=args.vram,
                        n_gpu_layers=args.n_gpu_layers, gpu_neurons=args.gpu_neurons, kv_vram=args.kv_vram), end="")
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
    except OptimlError as e:
        print(f"\n  cannot run: {e}")
    if args.plot:
        _plot_info(args, placed)
    return 0


def _info_json(path: str, tensors: bool) -> dict:
    """optiml info --json: the header, the metadata (arrays as their type and length), the placement of a
    placed file, and the hyperparameters the engine runs with (or why it cannot run the file)."""
    from .formats import gguf
    from .formats.placement import read_placement

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
    except OptimlError as e:
        out["hparams"], out["cannot_run"] = None, str(e)
    return out


def _show_placement(f) -> dict | None:
    """Prints the placement table of a placed file; returns read_placement's dict (None if unplaced)."""
    from .formats.placement import layer_bytes, read_placement

    pl = read_placement(f)
    if pl is None:
        return None
    k = pl["gpu_neurons"]
    cov = pl.get("coverage", [float("nan")] * len(k))
    sizes = layer_bytes(f, k)
    from .formats.placement import ffn_layout

    n_ff = ffn_layout(f)[1]
    print()
    print(f"  placement (optiml.placement.*, v{pl.get('version')}): FFN neurons hot-first, "
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
    print(f"  solver: {solver.get('method')} {solver.get('status')}, gap {solver.get('gap', 0):.3g}, "
          f"{solver.get('solve_s', 0):.2f} s; estimated {pl.get('est_token_ms', float('nan')):.2f} ms/token")
    if pl.get("hardware"):
        print(f"  hardware: {json.dumps(pl['hardware'], sort_keys=True)}")
    print(f"  stats: {pl.get('stats.tokens')} tokens from {str(pl.get('stats.sources', '')).replace(chr(10), ', ')} "
          f"(fingerprint {pl.get('stats.fingerprint')})")
    return pl


def _plot_info(args, placed: dict | None) -> None:
    """optiml info --plot: curves from --stats when given, else from the file's placement metadata."""
    import os

    from .formats.placement import coverage_curve, curve_ranks
    from .offline.coverage import plot

    name = os.path.basename(args.model)
    k = placed["gpu_neurons"] if placed else None
    if args.stats:
        from .formats import stats as S

        st = S.load(args.stats)
        if placed is None:
            st.check_model(args.model)
        n_ff = st.n_ff
        ranks = curve_ranks(n_ff)
        freq = -np.sort(-st.freq, axis=1)[:, ranks - 1]
        cov = coverage_curve(st.freq)[:, ranks - 1]
        src = f"stats: {st.n_tokens} tokens"
    elif placed is not None:
        ranks = np.asarray(placed["curve_ranks"])
        freq, cov = placed["curve_freq"], placed["curve_coverage"]
        n_ff = int(ranks[-1])
        src = f"placement metadata: {placed.get('stats.tokens')} tokens"
    else:
        raise OptimlError(f"{args.model} has no placement to plot; give the activation stats: --stats STATS.npz")
    plot(args.plot, ranks, freq, cov, n_ff, gpu_neurons=k, title=f"{name} ({src})")
    print(f"\n  wrote {args.plot}")


def cmd_system(args) -> int:
    print(json.dumps(_core.system_info(), indent=2))
    return 0


# ---- pull / chat ----------------------------------------------------------------------------------
def cmd_pull(args) -> int:
    from .hub import registry as models

    if args.list or not args.names:
        print(f"known models (cache: {models.cache_dir()}):")
        for mid, e in models.manifest().items():
            names = ", ".join([*e.get("aliases", []), mid])
            state = "cached" if models.is_cached(mid) else "not cached"
            print(f"  {names:55s} {e['size'] / 2**20:7.1f} MiB  {state}")
        return 0
    from .hub import huggingface as hub

    for n in args.names:
        if models.lookup(n) is None and hub.parse(n) is None:
            raise _core.ArgumentError(f"unknown model {n!r}; known: {', '.join(models.known())}; or a Hugging Face "
                                      "reference: org/repo:QUANT, org/repo/FILE.gguf")
    for n in args.names:
        print(models.pull(n, force=args.force, quiet=_quiet))
    return 0


def _sampling_args(p: argparse.ArgumentParser, temp: float = 0.8) -> None:
    p.add_argument("--temp", type=float, default=temp, help=f"temperature (0 = greedy; default {temp})")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")


def cmd_chat(args) -> int:
    from .chat import repl

    if args.model_opt:
        args.model = args.model_opt
    m = _load(args)
    sampling = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    repeat_penalty=args.repeat_penalty, seed=args.seed)
    return repl(m, system=args.system, max_tokens=args.n_predict, sampling=sampling)


# ---- hw -------------------------------------------------------------------------------------------
def cmd_hw(args) -> int:
    from .offline.hardware import Hardware
    from .util.sizes import parse_size

    say = None if args.quiet or args.json else (lambda msg: print(f"measuring {msg} ...", file=sys.stderr, flush=True))
    hw = Hardware.measure(device=args.device, types=args.types, weight_bytes=parse_size(args.size),
                          n_threads=args.threads or 0, progress=say)
    if args.output:
        hw.save(args.output)
    if args.json:
        _print_json(hw.to_dict())
        return 0
    print(f"CPU ({args.threads or _core.get_num_threads()} threads): read bandwidth {hw.cpu_bandwidth / 1e9:.1f} GB/s")
    print(f"  {'type':8} {'dense GB/s':>10} {'sparse rows GB/s':>16}")
    for t in hw.cpu_dense:
        print(f"  {t:8} {hw.cpu_dense[t] / 1e9:10.1f} {hw.cpu_sparse[t] / 1e9:16.1f}")
    if args.device:
        print(f"device {args.device}: memory traffic {hw.gpu_bandwidth / 1e9:.1f} GB/s, copies "
              f"{hw.transfer_bandwidth / 1e9:.1f} GB/s (pageable host memory), small copy and wait "
              f"{hw.transfer_latency * 1e6:.1f} us, event round trip {hw.sync_cost * 1e6:.1f} us, per op "
              f"{hw.launch_overhead * 1e6:.2f} us")
    if args.output:
        print(f"wrote {args.output} (optiml solve --hardware {args.output})")
    return 0


# ---- serve ----------------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    from .server import serve

    serve(_model(args.model), host=args.host, port=args.port, n_parallel=args.parallel, n_ctx=args.ctx,
          api_key=args.api_key, n_threads=args.threads, max_queue=args.queue, chunk=args.chunk, model_id=args.alias,
          predictors=_predictors(args), kv_vram=args.kv_vram, max_itl_ms=args.max_itl_ms, use_mmap=_use_mmap(args),
          **_device(args))
    return 0


# ---- convert --------------------------------------------------------------------------------------
def cmd_convert(args) -> int:
    from .convert import convert

    import os

    if not os.path.isdir(args.hf_dir):  # bad input (exit status 2), before any work
        raise _core.ArgumentError(f"{args.hf_dir}: not a folder (a Hugging Face model folder is expected)")
    t0 = time.perf_counter()
    convert(args.hf_dir, args.outfile, type=args.type, progress=not args.quiet)
    if not args.quiet:
        size = os.path.getsize(args.outfile)
        print(f"wrote {args.outfile} ({args.type}, {size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    return 0


# ---- solve ----------------------------------------------------------------------------------------
def _check_output(out: str, inputs: list[str]) -> None:
    """Errors about the output path, before any work: its folder must exist, and it must not be an input."""
    import os

    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise _core.ArgumentError(f"the output folder does not exist: {folder}")
    if os.path.isdir(out):
        raise _core.ArgumentError(f"the output is a folder, not a file: {out}")
    for i in inputs:
        if os.path.realpath(out) == os.path.realpath(i) or (os.path.exists(out) and os.path.samefile(out, i)):
            raise _core.ArgumentError(f"the output {out} is an input file; choose another name")


def cmd_solve(args) -> int:
    import warnings

    from .formats import stats as st
    from .offline.hardware import Hardware
    from .offline.solve import format_report, solve_placement
    from .util.sizes import parse_size

    _check_output(args.outfile, [args.stats])  # before a known model name could be pulled
    model = _model(args.model)
    _check_output(args.outfile, [model])
    vram = parse_size(args.vram)
    if args.ctx < 1:
        raise _core.ArgumentError(f"--ctx must be >= 1, not {args.ctx}")
    if args.group < 1:
        raise _core.ArgumentError(f"--group must be >= 1, not {args.group}")
    if not args.time_limit > 0:
        raise _core.ArgumentError(f"--time-limit must be > 0, not {args.time_limit}")
    stats = st.load(args.stats)
    hw = Hardware.auto() if args.hardware == "auto" else Hardware.from_json(args.hardware)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        placement = solve_placement(model, stats, vram, hw, ctx=args.ctx, group=args.group,
                                    time_limit=args.time_limit, batch=args.batch)
    for w in caught:
        print(f"optiml solve: warning: {w.message}", file=sys.stderr)
    print(format_report(placement))
    from .formats.placement import write_placed

    res = write_placed(model, stats, placement, args.outfile)
    if res["form"] == "permuted":
        how = "FFN neurons permuted hot-first in the file"
    else:
        how = ("weights kept in their order (quantized down tensors cannot move a neuron's column exactly), "
               "placed order in optiml.placement.neuron_order")
    print(f"wrote {args.outfile}: {how}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="optiml", description="Run large language models fast on one machine.")
    ap.add_argument("--version", action="version", version=f"optiml {__version__}")
    ap.add_argument("-q", "--quiet", dest="quiet_all", action="store_true",
                    help="no progress or log lines on stderr (errors still go there)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chat", help="talk with a model (interactive; /help inside)")
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct",
                   help="GGUF file or known model name (default: smollm2-135m-instruct)")
    p.add_argument("-m", "--model", dest="model_opt", default=None, help=MODEL_HELP)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--ctx", type=int, default=None, help="context length in tokens (default: the model's, at most 4096)")
    p.add_argument("--sparsity", choices=("auto", "threshold", "none"), default="auto", help=SPARSITY_HELP)
    p.add_argument("--predictors", default="auto", help=PREDICTORS_HELP)
    p.add_argument("-n", "--n-predict", type=int, default=None, help="most tokens per answer (default: until done)")
    p.add_argument("-s", "--system", default=None, help="system message")
    _add_device_args(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("pull", help="fetch known models or Hugging Face GGUFs into the cache (checksum checked)")
    p.add_argument("names", nargs="*", help="known model names or Hugging Face references (org/repo:Q4_K_M, "
                   "org/repo/FILE.gguf); none, or --list: list the known models")
    p.add_argument("--list", action="store_true", help="list the known models and whether they are cached")
    p.add_argument("-f", "--force", action="store_true", help="fetch again even when cached")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or log lines")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("run", help="generate text from a prompt")
    _add_model_args(p)
    p.add_argument("-p", "--prompt", help="prompt text (default: read stdin)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    _add_device_args(p)
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="prompt processing and generation speed (tokens/s)")
    _add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=128)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="instead of the speed table: time N decode steps op by op on each device and print where "
                        "the time goes per layer (busy, copies, waits, overlap of the host and the device)")
    p.add_argument("--trace", metavar="FILE", help="with --timeline: also write the spans as a Chrome trace (JSON)")
    _add_device_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("perplexity", help="perplexity of a text file (llama.cpp's convention); KL divergence "
                       "against a saved base model")
    _add_model_args(p)
    p.add_argument("-f", "--file", help="text file (needed except with --kl-divergence, which reads the base's tokens)")
    _add_device_args(p)
    p.add_argument("--chunks", type=int, default=-1, help="windows to score (default: all)")
    p.add_argument("--kl-divergence-base", metavar="FILE",
                   help="without --kl-divergence: save this model's log-probs of the scored tokens to FILE; "
                        "with it: the base to compare against")
    p.add_argument("--kl-divergence", action="store_true",
                   help="compare this model (or this --sparsity) with the base: KLD mean and percentiles, "
                        "same top token %%, delta PPL")
    p.add_argument("--kl-top-k", type=int, default=0, metavar="K",
                   help="save only the K most likely tokens per position (a smaller file; the KLD becomes a "
                        "lower bound); default 0: the full distribution, 2 bytes per vocabulary entry")
    p.add_argument("--json", action="store_true", help="print one JSON object with the results")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or log lines")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("tokenize", help="show the tokens of a text")
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("-p", "--prompt", help="text (default: read stdin)")
    p.add_argument("--ids", action="store_true", help="print only the list of ids")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS/EOS the model asks for")
    p.add_argument("--special", action="store_true", help="parse special-token text such as <|im_start|>")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("info", help="summary of a GGUF file")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw the activation power law and the coverage curve (pip install optiml[plot])")
    p.add_argument("--stats", metavar="STATS.npz", default=None,
                   help="activation statistics (optiml profile) to plot, e.g. for a model without a placement")
    p.add_argument("--plan", action="store_true",
                   help="print the execution plan instead: where each layer's attention and FFN neurons run")
    _add_device_args(p, loads_weights=False)
    p.add_argument("--ctx", type=int, default=None, help="context length per sequence for --plan (default: the "
                   "model's, at most 4096)")
    p.add_argument("--parallel", type=int, default=1, help="sequence slots for --plan")
    p.add_argument("--kv-vram", default=None, help="device memory for the KV cache, for --plan (see optiml serve)")
    p.add_argument("--json", action="store_true", help="print one JSON object: header, metadata, placement, "
                   "hyperparameters")
    p.set_defaults(func=cmd_info)

    from .convert.quant_mix import TYPES

    p = sub.add_parser("convert", help="convert a Hugging Face model folder to GGUF")
    p.add_argument("hf_dir", help="folder with config.json, *.safetensors and the tokenizer files")
    p.add_argument("-o", "--outfile", required=True, help="GGUF file to write")
    p.add_argument("--type", default="f16", choices=list(TYPES), help="output type (default f16)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("profile", help="record how often each FFN neuron fires on sample text")
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("--data", nargs="+", required=True, help="text files, or JSONL files with a text field")
    p.add_argument("--field", default="text", help="the JSONL field holding the text (default: text)")
    p.add_argument("--tokens", type=int, default=20000, help="tokens to profile (default 20000)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk, each from an empty context (512)")
    p.add_argument("--threshold", type=float, default=None,
                   help="a neuron fires when |act(gate)*up| exceeds this (default: 0 for ReLU models, else per layer "
                        "the value --active-share of the first chunk's activations exceed)")
    p.add_argument("--active-share", type=float, default=None, help="see --threshold (default 0.5)")
    p.add_argument("--samples", type=int, default=0, help="keep FFN inputs and firing masks of this many tokens")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", required=True, help="the stats file to write (.npz)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("calibrate", help="per-layer sparsity thresholds for a target share of skipped neurons")
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("--data", nargs="+", default=None, help="text or JSONL files to calibrate on")
    p.add_argument("--stats", default=None, help="stats from optiml profile on this model, instead of --data")
    p.add_argument("--target", type=float, default=0.5, help="share of FFN neurons to skip (default 0.5)")
    p.add_argument("--criterion", choices=("product", "weighted", "gate"), default="product",
                   help="skip by |act(gate)*up| (product: best quality, up computed densely), by |act(gate)| times "
                        "the neuron's mean |up| and down-column norm (weighted: also skips up rows; two profiling "
                        "passes), or by |act(gate)| (gate). Default product")
    p.add_argument("--allocation", choices=("uniform", "greedy"), default="uniform",
                   help="every layer the target (uniform), or spread to minimize estimated error (greedy)")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (512)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", required=True, help="the model copy to write, with the thresholds")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("train-predictors", help="train per-layer predictors of active FFN neurons (skip the gate too)")
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("--data", nargs="+", required=True, help="text or JSONL files to train on")
    p.add_argument("--field", default="text", help="the text field of JSONL objects (default text)")
    p.add_argument("--recall", type=float, default=0.99, help="per-layer recall of firing neurons to keep (0.99)")
    p.add_argument("--samples", type=int, default=4096, help="sample tokens (default 4096)")
    p.add_argument("--label-sparsity", type=float, default=None,
                   help="SwiGLU/GeGLU: share of neurons counted inactive when the model carries no calibrated "
                        "product thresholds (default 0.5)")
    p.add_argument("--max-rank", type=int, default=None, help="largest rank tried (default min(n_embd, 1024))")
    p.add_argument("--type", choices=("q8_0", "f16"), default=None, help="tensor type (default q8_0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (512)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", default=None, help="the predictor file (default MODEL.predictors.gguf)")
    p.set_defaults(func=cmd_train_predictors)

    p = sub.add_parser("solve", help="decide which FFN neurons go to the GPU (a MIP over activation stats)")
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("--stats", required=True, help="activation statistics (.npz from optiml profile)")
    p.add_argument("--vram", required=True,
                   help="GPU memory budget: bytes or a size with a unit (6GiB, 512MiB, 6GB)")
    p.add_argument("--hardware", "--hw", default="auto",
                   help="auto (measure the CPU bandwidth, defaults for the rest) or a JSON file from optiml hw -o")
    p.add_argument("--ctx", type=int, default=4096, help="context length whose KV cache is placed (default 4096)")
    p.add_argument("--group", type=int, default=64,
                   help="neurons per group (rounded up to the quant block size; default 64)")
    p.add_argument("--batch", type=int, default=512,
                   help="most tokens per step the model will run with (its n_batch), for the device's scratch")
    p.add_argument("--time-limit", type=float, default=30.0, help="HiGHS time limit in seconds (default 30)")
    p.add_argument("-o", "--outfile", required=True, help="GGUF file to write (neurons permuted, placement recorded)")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", "-np", type=int, default=4, help="sequences generated at once (KV slots)")
    p.add_argument("--ctx", type=int, default=None, help="context per slot (default: the model's, at most 4096)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--queue", type=int, default=64, help="sequences that may wait for a slot before 429")
    p.add_argument("--chunk", type=int, default=256, help="most prompt tokens run per step (across requests)")
    p.add_argument("--alias", default=None, help="model id clients use (default: the file name)")
    p.add_argument("--predictors", default="auto", help=PREDICTORS_HELP)
    _add_device_args(p)
    p.add_argument("--kv-vram", default=None,
                   help="device memory for the KV cache (a size: 2GiB); with less than --parallel sequences need, "
                        "the others keep their KV cache in host memory and their attention runs on the CPU while "
                        "the device runs the linear layers (CPU attention offload), when the measured costs say "
                        "it raises throughput")
    p.add_argument("--max-itl-ms", type=float, default=None,
                   help="with --kv-vram: start a sequence on the CPU only while a step stays within this many "
                        "milliseconds")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("hw", help="measure this machine for optiml solve: CPU product rates per weight type, and "
                       "with --device a GPU's bandwidth, copy latency and sync cost")
    p.add_argument("--device", default=None,
                   help="cuda[:N]: measure that GPU too (cpu:1: the same path on a second CPU device, for testing)")
    p.add_argument("--types", nargs="+", default=["q4_0", "q4_1", "q4_k", "q8_0"], help="weight types to time")
    p.add_argument("--size", default="256MiB", help="weights per timed product (beyond the caches; default 256MiB)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("-o", "--output", help="write the profile as JSON (for optiml solve --hardware FILE)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_hw)

    p = sub.add_parser("system", help="SIMD level, threads and CUDA devices of this build and machine")
    p.set_defaults(func=cmd_system)

    args = ap.parse_args(argv)
    global _quiet
    _quiet = args.quiet = args.quiet_all or getattr(args, "quiet", False)
    try:
        return args.func(args)
    except (_core.ArgumentError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        # Bad input: exit status 2, as argparse gives for a bad option.
        print(f"optiml {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (OptimlError, OSError, subprocess.CalledProcessError) as e:
        print(f"optiml {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
