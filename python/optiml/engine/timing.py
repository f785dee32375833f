"""Speed as llama-bench measures it: `optiml bench`, and the benchmarks in tools/ that time OptiML and
llama.cpp side by side with the same code."""

from __future__ import annotations

import statistics
import time

import numpy as np

__all__ = ["bench_model", "time_pp_tg"]


def time_pp_tg(engine, prompt: list[int], n_gen: int, after_pp=None, after_step=None) -> tuple[float, float]:
    """One llama-bench style run, in tokens/s: pp = the prompt as one batch from an empty context,
    tg = n_gen single-token steps from an empty context. Works on anything with reset() and eval(ids)
    (optiml.Model, llama_cpp.Llama), so one function times both engines. after_pp, after_step: called
    after the prompt and after each generation step (tg's time includes them), e.g. to measure the
    sparsity of a warm-up run."""
    engine.reset()
    t0 = time.perf_counter()
    engine.eval(prompt)
    t1 = time.perf_counter()
    if after_pp is not None:
        after_pp()
    engine.reset()
    t2 = time.perf_counter()
    for _ in range(n_gen):
        engine.eval(prompt[:1])
        if after_step is not None:
            after_step()
    t3 = time.perf_counter()
    return len(prompt) / (t1 - t0), n_gen / (t3 - t2)


def bench_model(model, n_prompt: int, n_gen: int, repeats: int) -> dict:
    """Median pp and tg tokens/s of `repeats` runs of time_pp_tg (after one warm-up run), and "pp_sparsity"
    and "tg_sparsity": the FFN neurons skipped in the warm-up's prompt and generation steps (SkipMeter
    summaries; the timed runs are not metered)."""
    prompt = np.random.default_rng(0).integers(0, model.n_vocab, n_prompt).tolist()
    pp_meter, tg_meter = model.sparsity_meter(), None

    def after_pp():
        nonlocal tg_meter
        pp_meter.step()
        tg_meter = model.sparsity_meter()

    time_pp_tg(model, prompt, n_gen, after_pp, lambda: tg_meter.step())  # also warms caches and page mappings
    runs = [time_pp_tg(model, prompt, n_gen) for _ in range(repeats)]
    model.reset()
    pp, tg = [r[0] for r in runs], [r[1] for r in runs]
    return {"pp": statistics.median(pp), "tg": statistics.median(tg), "pp_runs": pp, "tg_runs": tg,
            "pp_sparsity": pp_meter.summary(), "tg_sparsity": tg_meter.summary()}
