"""optiml train-predictors: per-layer predictors of the FFN neurons that fire, so the sparse FFN skips the
gate too (optiml.offline.predictors)."""

from __future__ import annotations

from ..engine.sparsity import break_even_share
from ..formats.predictors import default_predictor_path
from ..offline.predictors import train_predictors
from . import common


def add_arguments(p) -> None:
    common.add_data_args(p, "to train on")
    p.add_argument("--recall", type=float, default=0.99, help="per-layer recall of firing neurons to keep (0.99)")
    p.add_argument("--samples", type=int, default=4096, help="sample tokens (default 4096)")
    p.add_argument("--label-sparsity", type=float, default=None,
                   help="SwiGLU/GeGLU: share of neurons counted inactive when the model carries no calibrated "
                        "product thresholds (default 0.5)")
    p.add_argument("--max-rank", type=int, default=None, help="largest rank tried (default min(n_embd, 1024))")
    p.add_argument("--type", choices=("q8_0", "f16"), default=None, help="tensor type (default q8_0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (512)")
    p.add_argument("-t", "--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", default=None, help="the predictor file (default MODEL.predictors.gguf)")


def run(args) -> int:
    if args.output is not None:
        common.check_output(args.output, args.data)  # (before a known model name could be pulled)
    model = common.model_arg(args.model)
    out = args.output or default_predictor_path(model)
    common.check_output(out, [model, *args.data])
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
