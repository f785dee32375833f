"""Solve time of `optiml solve`'s program on 7B- and 70B-shaped problems with synthetic power-law stats.

    python tools/bench/solve.py [--group 64] [--time-limit 60] [--only 7b|70b]

Per layer, neuron firing frequencies follow a Zipf-like law freq_i = min(1, c * (i / n_ff)^-s) with c in
[0.01, 0.03] (the coldest neurons' rate) and s in [0.6, 0.95] (layers differ, as measured ones do; about 5-25%
of neurons fire per token), neurons are Q4_0-sized (gate + up + down: 3 * n_embd
elements at 18 bytes per 32), and the budget is half the FFN bytes (the goal's case), then an eighth (where
the budget binds). Prints the solve time, the goal and their
ratio (time / goal; below 1 meets it), the solver status and gap, and the greedy solution's objective for scale.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np

import harness

Hardware = harness.internal("hardware").Hardware
make_groups, solve_groups = harness.internal("solve").make_groups, harness.internal("solve").solve_groups

SHAPES = {"7b": (32, 11008, 4096, 10.0), "70b": (80, 28672, 8192, 60.0)}  # layers, n_ff, n_embd, goal (s)


def problem(n_layer: int, n_ff: int, n_embd: int, group: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    bytes_per_neuron = 3 * n_embd // 32 * 18  # Q4_0 gate row + up row + down column
    gbs, cbs = [], []
    for _ in range(n_layer):
        s = rng.uniform(0.6, 0.95)
        rank = np.arange(1, n_ff + 1, dtype=np.float64) / n_ff
        freq = np.minimum(1.0, rng.uniform(0.01, 0.03) * rank**-s)
        gb, cb = make_groups(np.sort(freq)[::-1], group, bytes_per_neuron)
        gbs.append(gb)
        cbs.append(cb)
    return gbs, cbs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=None, help="HiGHS time limit (default: the goal)")
    ap.add_argument("--only", choices=list(SHAPES), default=None)
    args, res = harness.parse(ap, "solve")
    hw = Hardware()
    for name, (L, F, E, goal) in SHAPES.items():
        if args.only and name != args.only:
            continue
        t0 = time.perf_counter()
        gbs, cbs = problem(L, F, E, args.group)
        t_build = time.perf_counter() - t0
        total = sum(int(g.sum()) for g in gbs)
        for frac in (2, 8):  # half the FFN (the goal's case), an eighth (a budget that binds)
            budget = total // frac
            greedy = solve_groups(gbs, cbs, budget, hw, method="greedy")
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                t0 = time.perf_counter()
                sol = solve_groups(gbs, cbs, budget, hw, time_limit=args.time_limit or goal)
                dt = time.perf_counter() - t0
            print(f"{name}: {L} layers x {F} neurons, {len(gbs[0])} groups of {args.group} per layer; "
                  f"budget {budget / 2**30:.2f} GiB (1/{frac} of the FFN), {sol.ffn_bytes / 2**30:.2f} GiB used")
            print(f"  solve {dt:.2f} s (goal {goal:.0f} s, ratio {dt / goal:.3f}); {sol.method}, status {sol.status}, "
                  f"gap {sol.gap:.1e}; stats built in {t_build:.2f} s")
            print(f"  est. FFN time/token {sol.objective_s * 1e3:.3f} ms (greedy {greedy.objective_s * 1e3:.3f} ms, "
                  f"{greedy.solve_s:.2f} s); {sum(sol.x)} of {sum(len(g) for g in gbs)} groups on the GPU")
            for m in w:
                print(f"  warning: {m.message}")
            res.add(shape=name, budget_of_ffn=f"1/{frac}", solve_s=dt, goal_s=goal, method=sol.method,
                    status=str(sol.status), gap=sol.gap, ffn_ms=sol.objective_s * 1e3,
                    greedy_ffn_ms=greedy.objective_s * 1e3, groups_on_gpu=int(sum(sol.x)))
    res.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
