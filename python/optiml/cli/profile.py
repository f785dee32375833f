"""optiml profile: record how often each FFN neuron fires on sample text (optiml.offline.profile)."""

from __future__ import annotations

from ..offline.profile import coverage_of_top, profile
from . import common


def add_arguments(p) -> None:
    common.add_data_args(p, "to profile")
    p.add_argument("--tokens", type=int, default=20000, help="tokens to profile (default 20000)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk, each from an empty context (512)")
    p.add_argument("--threshold", type=float, default=None,
                   help="a neuron fires when |act(gate)*up| exceeds this (default: 0 for ReLU models, else per layer "
                        "the value --active-share of the first chunk's activations exceed)")
    p.add_argument("--active-share", type=float, default=None, help="see --threshold (default 0.5)")
    p.add_argument("--samples", type=int, default=0, help="keep FFN inputs and firing masks of this many tokens")
    p.add_argument("-t", "--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", required=True, help="the stats file to write (.npz)")


def run(args) -> int:
    common.check_output(args.output, args.data)  # (before a known model name could be pulled)
    model = common.model_arg(args.model)
    common.check_output(args.output, [model])
    st = profile(model, args.data, n_tokens=args.tokens, out=args.output, n_ctx=args.ctx,
                 threshold=args.threshold, active_share=args.active_share, samples=args.samples, field=args.field,
                 n_threads=args.threads, progress=not args.quiet)
    if st.n_tokens < args.tokens:  # (the data ran out: stats from fewer tokens than asked for are noisier)
        common.log(f"profile: the data has {st.n_tokens} tokens, fewer than --tokens {args.tokens}: profiled all "
                   f"{st.n_tokens}")
    print(f"profiled {st.n_tokens} tokens of {st.model} ({st.activation}); a neuron fires when "
          f"|act(gate)*up| > threshold (layer mean {float(st.threshold.mean()):.4g})")
    if st.is_moe:
        X = st.expert_count.shape[1]
        print(f"experts: the top 10% of each layer's {X} take {st.expert_coverage(0.1):.1%} of the routings, the "
              f"top 25% {st.expert_coverage(0.25):.1%}; a token reuses {st.expert_reuse():.1%} of the experts the "
              f"token before it chose ({st.n_expert_used / X:.1%} if independent and even)")
        print(f"neurons inside the experts: mean firing rate {st.expert_firing_rate():.3f} on the tokens routed "
              "to them")
    else:
        print(f"mean firing rate {float(st.freq.mean()):.3f}; the top 10% of each layer's neurons cover "
              f"{coverage_of_top(st, 0.1):.1%} of firings, the top 20% {coverage_of_top(st, 0.2):.1%}")
    print(f"wrote {args.output}")
    return 0
