"""optiml perplexity: perplexity of a text file (llama.cpp's convention), and the KL divergence of a model
from a saved base."""

from __future__ import annotations

import sys
import time

from .._core import ArgumentError
from ..evaluate import perplexity as px
from ..engine.sparsity import describe, format_skipped
from . import common


def add_arguments(p) -> None:
    common.add_model_args(p)
    p.add_argument("-f", "--file", help="text file (needed except with --kl-divergence, which reads the base's tokens)")
    common.add_device_args(p)
    common.add_batch_arg(p)
    p.add_argument("--chunks", type=int, default=-1, help="windows to score (default -1: all, as llama.cpp's)")
    p.add_argument("--kl-divergence-base", metavar="FILE",
                   help="without --kl-divergence: save this model's log-probs of the scored tokens to FILE; "
                        "with it: the base to compare against")
    p.add_argument("--kl-divergence", action="store_true",
                   help="compare this model (or this --sparsity) with the base: KLD mean and percentiles, "
                        "same top token %%, delta PPL")
    p.add_argument("--kl-top-k", type=int, default=None, metavar="K",
                   help="with --kl-divergence-base FILE, when saving it: only the K most likely tokens per position "
                        "(a smaller file; the KLD becomes a lower bound); default 0: the full distribution, 2 bytes "
                        "per vocabulary entry")
    p.add_argument("--json", action="store_true", help="print one JSON object with the results")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or log lines")


def _progress(i, n, x):  # on stderr: stdout holds only the result; "[1]x,[2]y," as llama.cpp prints it
    if not common.quiet:
        print(f"[{i}]{x:.4f},", end="" if i < n else "\n", flush=True, file=sys.stderr)


def _metered(m):
    """(progress callback, SkipMeter): _progress, with each window (one step) metered for the FFN neurons
    it skipped."""
    meter = m.sparsity_meter()

    def progress(i, n, x):
        meter.step()
        _progress(i, n, x)

    return progress, meter


def _sparsity(m, meter) -> tuple[str, dict]:
    """The FFN's sparsity in use and the neurons it skipped, per window (a step) and mean: a line of text,
    and the --json object."""
    s = meter.summary()
    return (f"FFN: {describe(m.sparsity, m.predictors, m.sparsity_note)}; neurons skipped: {format_skipped(s)}",
            {"mode": s["mode"], "predictors": s["predictors"], "skipped": s["skipped"],
             "skipped_per_window": s["per_step"]})


def _read_text(path: str) -> str:
    """The text file as llama.cpp reads it: its bytes as they are (newline="": CRLF and lone CR line endings
    are kept, not turned into LF, so the tokens are llama.cpp's)."""
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        return f.read()


def _warn_past_training(m) -> None:
    """llama.cpp's warning for a context longer than the model was trained on (n_ctx_seq > n_ctx_train): the
    positions past it score what the model never learned, not how good it is."""
    n_train = int(m.hparams.get("n_ctx_train") or 0)
    if n_train and m.n_ctx > n_train:
        print(f"optiml perplexity: warning: the model was trained on only {n_train} context tokens, --ctx is "
              f"{m.n_ctx}: the windows' positions past {n_train} are beyond what it learned", file=sys.stderr)


def run(args) -> int:
    px.check_chunks(args.chunks)
    if args.kl_top_k is not None and args.kl_divergence:
        raise ArgumentError("--kl-top-k is for saving a base; --kl-divergence reads one as it was saved (its "
                            "top-k is in the file): leave --kl-top-k out")
    if args.kl_top_k is not None and not args.kl_divergence_base:
        raise ArgumentError("--kl-top-k sets what --kl-divergence-base FILE saves: give that too, or leave "
                            "--kl-top-k out")
    if args.kl_divergence:
        return _compare(args)
    t0 = time.perf_counter()
    if not args.file:
        raise ArgumentError("give the text with -f FILE")
    if args.kl_divergence_base:  # before any work: the base written over the text or the model would lose it
        common.check_output(args.kl_divergence_base, [args.file, common.model_arg(args.model)])
    text = _read_text(args.file)
    m = common.load(args, n_ctx=512 if args.ctx is None else args.ctx)
    _warn_past_training(m)
    progress, meter = _metered(m)
    if args.kl_divergence_base:
        ppl, err, count = px.save_base(args.kl_divergence_base, m, text, m.n_ctx, args.chunks, args.kl_top_k or 0,
                                       progress)
        common.log(f"saved the log-probs of {count} tokens to {args.kl_divergence_base}")
    else:
        ppl, err, count = px.perplexity(m, text, m.n_ctx, args.chunks, progress)
    common.log(f"{count} tokens scored in {time.perf_counter() - t0:.1f} s (n_ctx={m.n_ctx})")
    line, sparsity = _sparsity(m, meter)
    common.log(line)  # stdout holds only the result: "Final estimate: PPL = ..."
    if args.json:
        common.print_json({"model": args.model, "file": args.file, "n_ctx": m.n_ctx, "n_tokens": count, "ppl": ppl,
                           "ppl_err": err, "seconds": time.perf_counter() - t0,
                           "base_written": args.kl_divergence_base, "sparsity": sparsity})
        return 0
    print(f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}")  # llama.cpp's line, for the scripts that parse it
    return 0


def _compare(args) -> int:
    """--kl-divergence: this model against the base saved with --kl-divergence-base."""
    t0 = time.perf_counter()
    if not args.kl_divergence_base:
        raise ArgumentError("--kl-divergence compares against a saved base: give --kl-divergence-base FILE")
    base = px.read_base(args.kl_divergence_base)
    if args.ctx is not None and args.ctx != base.n_ctx:
        raise ArgumentError(f"the base was written with --ctx {base.n_ctx}; leave --ctx out or give {base.n_ctx}")
    text = _read_text(args.file) if args.file else None
    m = common.load(args, n_ctx=base.n_ctx)
    _warn_past_training(m)
    px.check_model(base, m)  # another vocabulary: refused before any window runs
    if text is not None:
        ws = px.windows(m, text, base.n_ctx, base.n_chunks,
                        advice=f"the base fixes the windows at {base.n_ctx} tokens; leave -f out: the base stores "
                               "its tokens")
        if len(ws) < base.n_chunks or any(w != base.window(i) for i, w in enumerate(ws)):
            raise ArgumentError(f"{args.file} does not tokenize to the base's tokens with this model "
                                "(the base stores its tokens: -f can be left out)")
    common.log(f"comparing with {base.path} ({base.model}, {base.n_chunks} windows of {base.n_ctx}); mean KLD:")
    progress, meter = _metered(m)
    r = px.compare(base, m, args.chunks, progress)
    common.log(f"{r.n} tokens scored in {time.perf_counter() - t0:.1f} s")
    line, sparsity = _sparsity(m, meter)
    if args.json:
        common.print_json({"model": args.model, "base": str(base.path), "base_model": base.model,
                           "n_ctx": base.n_ctx, "seconds": time.perf_counter() - t0, **r.summary(),
                           "sparsity": sparsity})
    else:
        print(line)  # what the KLD bought, above the report (which ends the output, as llama.cpp's)
        print()
        print(r.format())
    return 0
