"""Speed as llama-bench measures it, for `optiml bench` (tools/bench/harness.py times OptiML and llama.cpp side
by side in the benchmarks)."""

from __future__ import annotations

import statistics
import time

import numpy as np

__all__ = ["bench_tests", "time_test"]


def time_test(engine, prompt: list[int], n_prompt: int, n_gen: int, after_pp=None, after_step=None) -> float:
    """Seconds of one llama-bench test from an empty context: the first n_prompt tokens of `prompt` as one batch,
    then n_gen single-token steps of the tokens after them (pp: n_gen 0; tg: n_prompt 0; pg: both), as
    llama-bench feeds a new random token each step (one token fed again and again fires the same FFN neurons
    every step, which flatters the sparse FFN). Works on anything with reset() and
    eval(ids) (optiml.Model, llama_cpp.Llama). after_pp, after_step: called after the prompt and after each
    step, outside the time (e.g. to meter the sparsity of a warm-up run)."""
    engine.reset()
    spent = 0.0
    if n_prompt:
        t0 = time.perf_counter()
        engine.eval(prompt[:n_prompt])
        spent += time.perf_counter() - t0
        if after_pp is not None:
            after_pp()
    for i in range(n_gen):
        t = prompt[(n_prompt + i) % len(prompt)]
        t0 = time.perf_counter()
        engine.eval([t])
        spent += time.perf_counter() - t0
        if after_step is not None:
            after_step()
    return spent


def random_prompt(model, n: int) -> list[int]:
    """llama-bench's prompt: random token ids (the same ones every run)."""
    return np.random.default_rng(0).integers(0, model.n_vocab, max(n, 1)).tolist()


def bench_tests(model, tests: list[tuple[int, int]], repeats: int, warmup: bool = True) -> list[dict]:
    """llama-bench's table: for each (n_prompt, n_gen) test, `repeats` timed runs (after one warm-up run of
    each test unless warmup is False). Each row: "test" (pp512, tg128, pp512+tg128), "samples_ts" (tokens/s of
    each run), "avg_ts" and "stddev_ts" (their mean and sample standard deviation, as llama-bench reports), and
    "sparsity": the FFN neurons skipped in the warm-up's prompt and steps (SkipMeter summaries; None without a
    warm-up)."""
    prompt = random_prompt(model, max(p + g for p, g in tests))
    rows = []
    for n_prompt, n_gen in tests:
        sparsity = None
        if warmup:
            meters = {"pp": model.sparsity_meter(), "tg": model.sparsity_meter()}

            def after_pp():
                meters["pp"].step()
                meters["tg"] = model.sparsity_meter()  # (the steps' meter starts after the prompt)

            time_test(model, prompt, n_prompt, n_gen, after_pp, lambda: meters["tg"].step())
            sparsity = {k: meters[k].summary() for k, n in (("pp", n_prompt), ("tg", n_gen)) if n}
        ts = [(n_prompt + n_gen) / time_test(model, prompt, n_prompt, n_gen) for _ in range(repeats)]
        model.reset()
        name = "+".join(x for x in (f"pp{n_prompt}" if n_prompt else "", f"tg{n_gen}" if n_gen else "") if x)
        rows.append({"test": name, "n_prompt": n_prompt, "n_gen": n_gen, "samples_ts": ts,
                     "avg_ts": statistics.fmean(ts), "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0,
                     "sparsity": sparsity})
    return rows
