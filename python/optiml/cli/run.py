"""optiml run: generate text from a prompt."""

from __future__ import annotations

import sys
import time

from ..engine.sparsity import describe, format_skipped
from . import common


def add_arguments(p) -> None:
    common.add_model_args(p)
    p.add_argument("-p", "--prompt", help="prompt text (default: read stdin)")
    p.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=128,
                   help="tokens to generate (default 128; -1: until the end of generation or a full context)")
    common.add_device_args(p)
    common.add_batch_arg(p)
    common.add_sampling_args(p, seed_flags=("-s", "--seed"))
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true")


def run(args) -> int:
    common.n_predict(args.n_predict)  # (before the model loads)
    m = common.load(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    t0 = time.perf_counter()
    prompt_meter, gen_meter = m.sparsity_meter(), None
    for piece in m.stream(prompt, max_tokens=common.n_predict(args.n_predict), **common.sampling(args)):
        # The first piece comes once the prompt ran; each later one after a decode step (or a few, when a
        # stop string held pieces back).
        if gen_meter is None:
            prompt_meter.step()
            gen_meter = m.sparsity_meter()
        else:
            gen_meter.step()
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    wanted = common.n_predict(args.n_predict)
    made = m.last_stats["gen_tokens"]
    if m.n_past >= m.n_ctx - 1 and (wanted is None or made < wanted):
        common.log(f"[context full: {made} tokens generated{'' if wanted is None else f' of {wanted}'}; "
                   f"a larger --ctx ({m.n_ctx} now) for more]")
    common.log(sparsity_line(m, prompt_meter.summary(), gen_meter.summary() if gen_meter else None))
    if args.verbose:
        dt = time.perf_counter() - t0
        print(f"[{m.n_past} tokens in context, {dt:.2f} s]", file=sys.stderr)
    return 0


def sparsity_line(m, prompt: dict, gen: dict | None) -> str:
    """The FFN's sparsity in use and the neurons it skipped in the prompt and the generation (SkipMeter
    summaries), as one log line."""
    return (f"FFN: {describe(m.sparsity, m.predictors, m.sparsity_note)}; neurons skipped: prompt {format_skipped(prompt)}, "
            f"generation {format_skipped(gen) if gen else '-'}")
