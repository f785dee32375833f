"""`optiml solve`: which FFN neurons of each layer go to the GPU, decided by a mixed-integer program.

What is placed
    Everything with a higher priority than FFN neurons goes to the GPU first, counted exactly from the GGUF:
    every tensor of the model except the FFN gate/up/down matrices and the token embeddings (llama.cpp keeps
    those on the CPU; when the model ties its output matrix to them, they are counted once, as the output
    matrix), then the f16 KV cache for `ctx` tokens (K and V: n_layer * ctx * n_head_kv * head_dim * 2 bytes
    each), the device's scratch for steps of `batch` tokens (at most ctx) and the logits rows beside the
    output matrix (as the plan counts them).

    When that fixed part does not fit the budget, the attention (with its norms and KV cache) of the last m
    layers goes to the GPU, and the output matrix after them when chosen (the plan puts the logits on the
    device where the last layer's attention is and the output fits); FFN groups go wherever they pay. Each
    layer then pays the split cost where its data crosses: attention on the GPU and any FFN neuron on the
    CPU, or attention on the CPU and any neuron on the GPU (layer_times), and the residual stream's crossings
    are counted once each. Every (m, output) that fits is scored with the greedy placement below, and the
    best and its neighbours are solved by the program (those up to four programs share the time limit, so
    the search as a whole keeps to it; a warning when any of them stopped at it). The placed file records
    the choice (optiml.placement.gpu_attention) and the plan follows it. Only when not even one layer's
    attention fits (or nothing on the GPU pays for its transfers) does everything stay on the CPU, with a
    warning.

    The FFN neurons of layer l are taken in hot-first order (optiml.formats.stats.hot_first_order) and cut into
    G_l groups of g neurons; g is the smallest multiple of every ffn_down block size (32, or 256 for K-quants)
    that is >= the requested group, so a group's bytes are exact: g * (gate row + up row bytes) + g / block *
    (bytes of one block column of ffn_down). The last group is partial when g does not divide n_ff (counted
    exactly). The GPU share of layer l is always a prefix: placed neurons [0, k_l) of the hot-first order
    (optiml.formats.placement writes that order into the file exactly: permuted weights, or the weights as
    they are plus neuron_order). In the second form, which a quantized down tensor needs, the plan holds a
    split layer's device share as gate and up rows and 8-bit neuron-major down rows with one set of scales
    (plan.cpp ffn_share_bytes), so the device bytes of x < G groups are x * that per group + the scales, and
    of all G groups the layer's own bytes (layer_bytes).

The program (per layer l; times in microseconds inside the solver)
    x_l in {0..G_l}  groups on the GPU          a_l in {0,1}: x_l >= 1  (x_l <= G_l a_l)
    b_l in {0,1}: x_l = G_l (x_l >= G_l b_l, x_l <= G_l - 1 + b_l)
    s_l >= 1 - b_l: the layer's data crosses (its attention is on the GPU and some FFN neuron on the CPU; with
               its attention on the CPU, s_l >= a_l; solve_groups without attention: s_l >= a_l - b_l)
    bytes_l(x)  = S_l x + A_l a_l + B_l b_l                   exact device bytes of the first x groups
               (S_l the bytes of a group, A_l = 0, B_l = the last group's difference; or, for a file that keeps
               its order, S_l a group's split bytes, A_l the scales, B_l what the whole layer saves)
    t_l >= bytes_l(x) / gpu_bandwidth + launch_overhead a_l   the GPU share's time
    t_l >= cpu_l(x) + P_l (1 - b_l)                           the CPU share's time, run concurrently
    cpu_l(x) = the CPU's time for its neurons as the engine reads them (optiml.offline.time_model.
               neuron_cpu_bytes: what decides who fires at the dense rate, the rest of each firing neuron at
               the row-sparse rate). In hot-first order its slope only shrinks, so it is convex and
               decreasing, and equals the largest of the lines through consecutive group points: t_l >= each
               such line. Lines beyond the first group point where the GPU time alone already exceeds the CPU's
               are dropped: there the GPU bound is the larger one, so the optimum is unchanged and the model
               stays exact at every integer x (no approximation). P_l: what the CPU pays whenever it keeps
               any neuron (a predictor scores all of them).
    minimize    sum_l t_l + split_cost s_l            (split_cost = transfer latency + sync, per crossing layer)
    subject to  fixed + sum_l bytes_l(x_l) <= budget
    HiGHS solves it with a time limit and a relative gap, warm-started from the greedy solution below. The
    returned x is re-checked in exact integer bytes (and trimmed if floating-point tolerance let it overshoot).

Greedy (the fallback if HiGHS fails or has no solution in time): repeatedly give the layer with the best
time saved per byte (looking ahead to any larger x of that layer, which handles the launch and split steps)
the groups it asks for while they fit.

Consequence of the time model: the GPU reads its share densely while the CPU reads only the neurons that fire
(beyond what decides who fires), so past the point where a layer's GPU time exceeds its CPU time, more GPU
neurons only cost time; cold tails can stay on the CPU even when the budget has room for them.

The estimate per token is the objective plus each layer's attention and the output on their device, timed by
optiml.offline.time_model (weights at the CPU's dense rate or the GPU's bandwidth, the KV cache of
`positions` past tokens, the device's ops and the logits' copy).
"""

from __future__ import annotations

import ctypes
import heapq
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from .._core import ArgumentError
from ..formats import gguf
from ..formats.quant import type_info
from ..formats.stats import hot_first_order
from ..util.sizes import mib
from .hardware import Hardware
from ..formats.placement import down_permutable
from .time_model import (FixedTimes, dense_down_seconds, ffn_mode, fixed_layout, fixed_times, neuron_cpu_bytes,
                         predictor_costs, predictor_seconds)

__all__ = ["Placement", "GroupSolution", "make_groups", "layer_bytes", "layer_times", "solve_groups",
           "solve_placement", "format_report", "attention_line", "SolveWarning"]


class SolveWarning(UserWarning):
    """The placement is valid but not what was asked for (all-CPU, greedy fallback, time limit)."""


# ---- results --------------------------------------------------------------------------------------
@dataclass
class Placement:
    gpu_neurons: list[int]   # k_l per layer: neurons [0, k_l) of the hot-first order go to the GPU
    group: int               # neurons per group
    vram_budget: int         # bytes asked for
    vram_used: int           # bytes placed: fixed part (if it fit) + FFN share, counted exactly
    fixed_bytes: int         # attention, norms, output, KV cache for ctx, predictors
    ctx: int
    hardware: dict           # the Hardware used, JSON-able
    est_token_s: float       # estimated time per token (the objective + the fixed part)
    method: str              # "mip", "greedy" or "all-cpu"
    status: str              # HiGHS model status text, or why greedy/all-cpu
    gap: float               # relative MIP gap (nan for greedy/all-cpu: not applicable)
    solve_s: float
    coverage: list[float]    # per layer: share of all firings (sum of freq) covered by the GPU neurons
    cpu_only_token_s: float = math.nan  # the same estimate with everything on the CPU, for comparison
    ffn_bytes: list[int] = field(default_factory=list)  # per layer: all FFN bytes (gate + up + down)
    gpu_ffn_bytes: list[int] = field(default_factory=list)  # per layer: FFN bytes on the GPU
    # per layer: its attention and KV cache on the GPU. All True when the fixed part fits; when it does not,
    # the layers [0, m) the solver chose (see solve_placement); empty: not decided (all where they fit).
    gpu_attention: list[bool] = field(default_factory=list)
    # a mixture of experts (optiml.offline.solve_experts): per layer the experts on the GPU, hottest first
    gpu_experts: list[list[int]] = field(default_factory=list)
    output_on_gpu: bool = False  # the output matrix on the GPU (the estimate counts it there)
    positions: int = 0           # past tokens a decode step attends to, in the estimate
    predictors: str = ""         # the predictor file the estimate counts (its name), or none
    # cpu_only_token_s by part, seconds: {"attention": all layers', "ffn": all layers', "output": the logits'}
    cpu_only_parts: dict = field(default_factory=dict)
    # vram_used by part, bytes: {"scratch", "kv_cache", "weights" (attention, norms, output and its logits
    # rows, and for experts the routers and shared experts), "ffn"}; empty: not known
    used_parts: dict = field(default_factory=dict)


@dataclass
class GroupSolution:
    x: list[int]             # groups on the GPU per layer
    objective_s: float       # sum of the layers' times per token (seconds), evaluated exactly for x
    ffn_bytes: int           # bytes of the groups on the GPU, exact
    method: str              # "mip" or "greedy"
    status: str
    gap: float
    solve_s: float


# How far from the optimum HiGHS may stop: half a percent of a token's estimated time, far inside the time
# model's own error (tools/bench/time_model.py: measured steps 1.15-1.25x the estimate). The last fractions of
# a percent are what HiGHS closes slowly: at 1e-4, SmolLM2's placements took 23-30 s (the time limit) for
# estimates within 0.1% of what 5e-3 gives in 0.1 s.
MIP_GAP = 5e-3


# ---- the per-layer model --------------------------------------------------------------------------
def make_groups(sorted_freq: np.ndarray, group: int, bytes_of: int | Callable[[int], int]):
    """One layer's solver input from its hot-first firing frequencies: (group_bytes int64 [G], cpu_bytes f64 [G]).
    bytes_of: bytes per neuron (int), or a function giving the exact bytes of n neurons (n a multiple of the
    block size). cpu_bytes[j] = the expected bytes the CPU reads per token for group j when it stays there."""
    f = np.asarray(sorted_freq, dtype=np.float64)
    n = len(f)
    if group < 1:
        raise ArgumentError(f"group must be >= 1, not {group}")
    if callable(bytes_of):
        fn = bytes_of
    else:
        bpn = int(bytes_of)
        fn = lambda k: k * bpn  # noqa: E731
    G = -(-n // group)
    sizes = np.full(G, group, dtype=np.int64)
    if G and n % group:
        sizes[-1] = n % group
    gb = np.array([fn(int(s)) for s in sizes], dtype=np.int64)
    fsum = np.add.reduceat(f, np.arange(0, n, group)) if n else np.zeros(0)
    cb = fsum * gb / sizes
    return gb, cb


def layer_bytes(group_bytes: np.ndarray, split: tuple | None = None) -> tuple[np.ndarray, tuple]:
    """Device bytes of one layer for every x = 0..G groups on the GPU, and the same as the linear form the
    program uses: bytes(x) = s x + c_a a + c_b b (a: x >= 1, b: x = G). Without `split` the groups' own bytes
    (a file whose neurons are permuted: a share is a block of the layer's tensors). With split = (bytes per
    group, bytes once) a share of x < G groups takes x groups of other bytes and a constant (a file that keeps
    its order, optiml.placement.neuron_order: the plan holds a split share's down as 8-bit neuron-major rows
    with their scales, plan.cpp ffn_share_bytes); the whole layer takes its own bytes either way."""
    gb = np.asarray(group_bytes, dtype=np.int64)
    G = len(gb)
    if G == 0:
        return np.zeros(1, dtype=np.int64), (0, 0, 0)
    total = int(gb.sum())
    if split is None or G == 1:
        lin = (int(gb[0]), 0, int(gb[-1]) - int(gb[0]))
    else:
        per, once = int(split[0]), int(split[1])
        lin = (per, once, total - G * per - once)
    x = np.arange(G + 1, dtype=np.int64)
    return lin[0] * x + lin[1] * (x > 0) + lin[2] * (x == G), lin


def layer_times(group_bytes: np.ndarray, cpu_bytes: np.ndarray, hw: Hardware, attention: str | None = None,
                split: tuple | None = None, cpu_fixed: float = 0.0) -> np.ndarray:
    """Seconds per token of one layer for every x = 0..G groups on the GPU: the larger of the GPU and the CPU
    share's time, plus the split cost where the layer's data crosses between the devices: when 0 < x < G
    (attention None: every layer's attention on the GPU as the fixed part, the model of the module doc);
    with attention "gpu" when x < G (the CPU computes some of the FFN), with "cpu" when x > 0. split: the
    device's bytes of a split share (layer_bytes); cpu_fixed: seconds the CPU's share costs whatever its size
    (a predictor scores every neuron of the layer)."""
    cb = np.asarray(cpu_bytes, dtype=np.float64)
    G = len(cb)
    gpu = layer_bytes(group_bytes, split)[0] / hw.gpu_bandwidth
    gpu[1:] += hw.launch_overhead
    cpu = np.concatenate([np.cumsum(cb[::-1])[::-1], [0.0]]) / hw.cpu_bandwidth
    cpu[:G] += cpu_fixed
    t = np.maximum(gpu, cpu)
    if attention is None:
        if G > 1:
            t[1:G] += hw.split_cost
    elif attention == "gpu":
        t[:G] += hw.split_cost
    else:
        t[1:] += hw.split_cost
    return t


def _check_inputs(group_bytes, cpu_bytes, budget):
    if len(group_bytes) != len(cpu_bytes):
        raise ArgumentError(f"{len(group_bytes)} layers of group bytes but {len(cpu_bytes)} of CPU bytes")
    if int(budget) < 0:
        raise ArgumentError(f"the budget cannot be negative: {budget}")
    gbs, cbs = [], []
    for l, (gb, cb) in enumerate(zip(group_bytes, cpu_bytes)):
        gb = np.asarray(gb, dtype=np.int64)
        cb = np.asarray(cb, dtype=np.float64)
        if gb.ndim != 1 or cb.shape != gb.shape:
            raise ArgumentError(f"layer {l}: group bytes {gb.shape} and CPU bytes {cb.shape} differ in shape")
        if len(gb) and (np.any(gb[:-1] != gb[0]) or gb[-1] > gb[0] or gb[-1] <= 0):
            raise ArgumentError(f"layer {l}: all groups but a smaller last one must have the same bytes")
        if np.any(cb < 0) or np.any(np.diff(cb) > 1e-9 * max(1.0, float(cb.max(initial=0)))):
            raise ArgumentError(f"layer {l}: CPU bytes per group must be >= 0 and non-increasing (hot-first order)")
        gbs.append(gb)
        cbs.append(cb)
    return gbs, cbs


def _greedy(times: list[np.ndarray], cumb: list[np.ndarray], budget: int) -> list[int]:
    """Best time saved per byte first, looking ahead to every larger x of a layer (handles the step costs)."""
    x = [0] * len(times)
    left = int(budget)

    def best(l):
        cur = x[l]
        cb = cumb[l]
        d_bytes = cb[cur + 1:] - cb[cur]
        ok = d_bytes <= left
        if not ok.any():
            return None
        gain = times[l][cur] - times[l][cur + 1:]
        ratio = np.where(ok & (gain > 0), gain / np.maximum(d_bytes, 1), -np.inf)
        j = int(np.argmax(ratio))
        if not math.isfinite(ratio[j]):
            return None
        return float(ratio[j]), cur + 1 + j

    heap = []
    for l in range(len(times)):
        b = best(l)
        if b:
            heap.append((-b[0], l, b[1]))
    heapq.heapify(heap)
    while heap:
        neg, l, to = heapq.heappop(heap)
        b = best(l)  # the budget may have shrunk since this entry was pushed
        if b is None:
            continue
        if (b[0], b[1]) != (-neg, to):
            heapq.heappush(heap, (-b[0], l, b[1]))
            continue
        left -= int(cumb[l][to] - cumb[l][x[l]])
        x[l] = to
        b = best(l)
        if b:
            heapq.heappush(heap, (-b[0], l, b[1]))
    return x


def _mip(gbs, cbs, budget, hw, x0, time_limit, mip_gap, att=None, splits=None, fixed=None):
    """Builds and solves the program of the module docstring. Returns (x or None, status, gap). att: per layer
    where its attention runs ("gpu", "cpu"), or None for the module doc's model (see layer_times); splits and
    fixed: per layer, layer_times' split and cpu_fixed."""
    import highspy

    L = len(gbs)
    US = 1e6  # seconds -> microseconds inside the solver
    unit = float(max(int(gb[0]) for gb in gbs if len(gb)))  # memory row scaled to about 1 per group
    nv = 5 * L  # per layer: x, a, b, s, t
    lb = np.zeros(nv)
    ub = np.zeros(nv)
    cost = np.zeros(nv)
    integ = np.zeros(nv, dtype=np.int64)
    rows_lo, rows_hi, starts, idx, val = [], [], [], [], []

    def row(ix, vx, lo, hi):
        starts.append(len(idx))
        idx.extend(ix)
        val.extend(vx)
        rows_lo.append(lo)
        rows_hi.append(hi)

    inf = highspy.kHighsInf
    mem_ix, mem_v = [], []
    seg_blocks = []  # (t col, x col, slopes, intercepts) per layer, added as numpy blocks
    for l in range(L):
        X, A, B, S, T = 5 * l, 5 * l + 1, 5 * l + 2, 5 * l + 3, 5 * l + 4
        G = len(gbs[l])
        ub[[X, A, B, S, T]] = [G, 1, 1, 1, inf]
        integ[[X, A, B, S]] = 1
        cost[T] = 1.0
        cost[S] = hw.split_cost * US
        if G == 0:
            continue
        cum, (Bs, Ba, Bb) = layer_bytes(gbs[l], splits[l] if splits else None)
        P = float(fixed[l]) * US if fixed else 0.0  # the CPU's cost whenever it keeps any neuron
        row([X, A], [1, -G], -inf, 0)               # x <= G a
        row([X, B], [1, -G], 0, inf)                # x >= G b
        row([X, B], [1, -1], -inf, G - 1)           # x = G -> b = 1
        where = att[l] if att else None
        if where is None:
            row([S, A, B], [1, -1, 1], 0, inf)      # s >= a - b
        elif where == "gpu":
            row([S, B], [1, 1], 1, inf)             # s >= 1 - b
        else:
            row([S, A], [1, -1], 0, inf)            # s >= a
        k = US / hw.gpu_bandwidth
        row([T, X, A, B], [1, -Bs * k, -(Ba * k + hw.launch_overhead * US), -Bb * k], 0, inf)
        mem_ix += [X, A, B]
        mem_v += [Bs / unit, Ba / unit, Bb / unit]
        # CPU: lines through consecutive group points (plus P while b = 0), up to where the GPU time alone is
        # larger
        c = np.concatenate([np.cumsum(cbs[l][::-1])[::-1], [0.0]]) / hw.cpu_bandwidth * US
        g0 = cum / hw.gpu_bandwidth * US
        m = int(np.argmax(g0 >= c + P * (np.arange(G + 1) < G)))  # (at x = G both are 0, so it exists)
        if m > 0:
            j = np.arange(m)
            slope = c[j + 1] - c[j]
            seg_blocks.append((T, X, B, P, slope, c[j] - slope * j))
    row(mem_ix, mem_v, -inf, budget / unit)

    h = _silent_highs(highspy)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.addVars(nv, lb, ub)
    h.changeColsCost(nv, np.arange(nv, dtype=np.int32), cost)
    icols = np.flatnonzero(integ).astype(np.int32)
    h.changeColsIntegrality(len(icols), icols, np.full(len(icols), highspy.HighsVarType.kInteger))
    h.addRows(len(rows_lo), np.array(rows_lo), np.array(rows_hi), len(idx), np.array(starts, dtype=np.int32),
              np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))
    for T, X, B, P, slope, icpt in seg_blocks:  # t - slope x + P b >= intercept + P
        n = len(slope)
        h.addRows(n, icpt + P, np.full(n, inf), 3 * n, np.arange(0, 3 * n, 3, dtype=np.int32),
                  np.tile(np.array([T, X, B], dtype=np.int32), n),
                  np.column_stack([np.ones(n), -slope, np.full(n, P)]).ravel())
    if x0 is not None:
        sol = np.zeros(nv)
        for l, xl in enumerate(x0):
            G = len(gbs[l])
            a, b = float(xl > 0), float(G > 0 and xl == G)
            where = att[l] if att else None
            split = max(0.0, a - b) if where is None else (1.0 - b if where == "gpu" else a)
            sol[5 * l: 5 * l + 4] = [xl, a, b, split]
            cum = layer_bytes(gbs[l], splits[l] if splits else None)[0]
            t_gpu = (float(cum[xl]) / hw.gpu_bandwidth + hw.launch_overhead * a) * US
            t_cpu = (float(np.sum(cbs[l][xl:])) / hw.cpu_bandwidth + (fixed[l] if fixed and xl < G else 0.0)) * US
            sol[5 * l + 4] = max(t_gpu, t_cpu) * (1 + 1e-9) + 1e-9
        hs = highspy.HighsSolution()
        hs.col_value = sol.tolist()
        hs.value_valid = True
        h.setSolution(hs)
    h.run()
    ms = h.getModelStatus()
    status = h.modelStatusToString(ms)
    info = h.getInfo()
    if info.primal_solution_status != 2:  # kSolutionStatusFeasible
        return None, status, math.nan
    xs = np.asarray(h.getSolution().col_value)[0::5]
    return [int(round(v)) for v in xs], status, float(info.mip_gap)


def solve_groups(group_bytes: Sequence[np.ndarray], cpu_bytes: Sequence[np.ndarray], budget: int,
                 hardware: Hardware, time_limit: float = 30.0, mip_gap: float = MIP_GAP,
                 method: str = "auto", attention: Sequence[str] | None = None,
                 split_bytes: Sequence[tuple | None] | None = None,
                 cpu_fixed: Sequence[float] | None = None) -> GroupSolution:
    """The program on plain arrays, without a model file. Per layer l (hot-first order):
    group_bytes[l]: int [G_l], the exact bytes of each group (all equal but a possibly smaller last one);
    cpu_bytes[l]: float [G_l], expected bytes read per token for the group when it is on the CPU (sum of
    freq * bytes per neuron; non-increasing). budget: bytes for the FFN groups.
    method: "auto" (MIP; greedy with a SolveWarning if HiGHS has no solution), "mip" (same) or "greedy".
    attention: per layer "gpu" or "cpu", where its attention runs (see layer_times), or None.
    split_bytes, cpu_fixed: per layer, layer_times' split and cpu_fixed (None: none)."""
    if method not in ("auto", "mip", "greedy"):
        raise ArgumentError(f"method must be auto, mip or greedy, not {method!r}")
    if not (time_limit > 0):
        raise ArgumentError(f"the time limit must be > 0 seconds, not {time_limit}")
    if not (0 <= mip_gap < 1):
        raise ArgumentError(f"the MIP gap must be in [0, 1), not {mip_gap}")
    gbs, cbs = _check_inputs(group_bytes, cpu_bytes, budget)
    budget = int(budget)
    t0 = time.perf_counter()
    if attention is not None and (len(attention) != len(gbs) or any(a not in ("gpu", "cpu") for a in attention)):
        raise ArgumentError(f"attention must give 'gpu' or 'cpu' for each of the {len(gbs)} layers")
    att = list(attention) if attention is not None else [None] * len(gbs)
    for name, v in (("split_bytes", split_bytes), ("cpu_fixed", cpu_fixed)):
        if v is not None and len(v) != len(gbs):
            raise ArgumentError(f"{name} must give a value for each of the {len(gbs)} layers")
    splits = list(split_bytes) if split_bytes is not None else [None] * len(gbs)
    fixed = [float(v) for v in cpu_fixed] if cpu_fixed is not None else [0.0] * len(gbs)
    times = [layer_times(gb, cb, hardware, a, sp, f) for gb, cb, a, sp, f in zip(gbs, cbs, att, splits, fixed)]
    cumb = [layer_bytes(gb, sp)[0] for gb, sp in zip(gbs, splits)]
    xg = _greedy(times, cumb, budget)
    x, how, status, gap = xg, "greedy", "greedy: asked for", math.nan
    if method != "greedy" and any(len(gb) for gb in gbs):
        xm, st, g = _mip(gbs, cbs, budget, hardware, xg, time_limit, mip_gap, attention, splits, fixed)
        if xm is None:
            status = f"greedy: HiGHS found no solution ({st})"
            warnings.warn(f"HiGHS found no solution ({st}); using the greedy placement", SolveWarning, stacklevel=2)
        else:
            x, how, status, gap = xm, "mip", st, g
            if st == "Time limit reached":
                gap_text = f"a gap of {g:.2%}" if math.isfinite(g) else "no bound on the gap yet"
                warnings.warn(f"HiGHS stopped at its time limit of {time_limit:g} s with {gap_text}; "
                              "using its best solution so far (at least as good as greedy)", SolveWarning,
                              stacklevel=2)
    elif method != "greedy":
        x, how, status, gap = xg, "mip", "Optimal (nothing to place)", 0.0
    x = [min(max(int(v), 0), len(gb)) for v, gb in zip(x, gbs)]
    used = sum(int(c[v]) for v, c in zip(x, cumb))
    while used > budget:  # tolerance overshoot: drop the group whose loss per byte is smallest
        cands = [((times[l][x[l] - 1] - times[l][x[l]]) / int(cumb[l][x[l]] - cumb[l][x[l] - 1]), l)
                 for l in range(len(x)) if x[l] > 0 and cumb[l][x[l]] > cumb[l][x[l] - 1]]
        _, l = min(cands)
        used -= int(cumb[l][x[l]] - cumb[l][x[l] - 1])
        x[l] -= 1
    obj = float(sum(t[v] for t, v in zip(times, x)))
    return GroupSolution(x=x, objective_s=obj, ffn_bytes=used, method=how, status=status, gap=gap,
                         solve_s=time.perf_counter() - t0)


# ---- the model file -------------------------------------------------------------------------------
_FFN = ("ffn_gate", "ffn_up", "ffn_down")


def _model_layout(path, group: int):
    """From the GGUF: per-layer exact FFN bytes for groups (and per neuron: gate row, up row and down column with
    their types), the fixed part (time_model.fixed_layout), hyper-parameters, the file's sparsity criterion."""
    with gguf.open(path) as f:
        md = f.metadata
        arch = str(md.get("general.architecture", ""))
        n_layer = int(md.get(f"{arch}.block_count", 0))
        tensors = {t.name: t for t in f.tensors}
    if any(".ffn_up_exps" in n or ".ffn_gate_inp" in n for n in tensors):
        raise ArgumentError(f"{os.path.basename(path)}: mixture-of-experts FFNs are not supported by optiml solve")
    if arch == "phi3":
        raise ArgumentError(f"{os.path.basename(path)}: phi3 keeps each layer's gate and up in one tensor; optiml "
                            "solve does not place its neurons yet (run it whole on one device, or sparse on the CPU "
                            "after optiml calibrate)")
    layers = []
    for l in range(n_layer):
        up, down = tensors.get(f"blk.{l}.ffn_up.weight"), tensors.get(f"blk.{l}.ffn_down.weight")
        gate = tensors.get(f"blk.{l}.ffn_gate.weight")
        if up is None or down is None:
            layers.append(None)
            continue
        n_ff = int(up.shape[1])
        if int(down.shape[0]) != n_ff or (gate is not None and int(gate.shape[1]) != n_ff):
            raise ArgumentError(f"layer {l}: FFN tensors disagree on n_ff ({up.shape}, {down.shape})")
        bs = type_info(down.type).block_size
        rows = [t for t in (gate, up) if t is not None]
        row_bytes = sum(t.n_bytes // n_ff for t in rows)
        if any(t.n_bytes % n_ff for t in rows) or n_ff % bs or down.n_bytes % (n_ff // bs):
            raise ArgumentError(f"layer {l}: FFN tensor sizes are not whole rows/blocks per neuron")
        col_block = down.n_bytes // (n_ff // bs)
        layers.append(dict(n_ff=n_ff, block=bs, row_bytes=row_bytes, col_block=col_block,
                           total=sum(t.n_bytes for t in rows) + down.n_bytes, ffn_type=type_info(up.type).name,
                           gate_row=gate.n_bytes // n_ff if gate is not None else 0,
                           gate_type=type_info(gate.type).name if gate is not None else "",
                           up_row=up.n_bytes // n_ff, up_type=type_info(up.type).name,
                           down=col_block / bs, down_type=type_info(down.type).name,
                           down_row=int(down.shape[1]) * 34 / 32))  # the sparse FFN's 8-bit neuron-major copy
    if n_layer == 0 or all(v is None or v["n_ff"] == 0 for v in layers):
        raise ArgumentError(f"{os.path.basename(path)} has no FFN neurons to place (no ffn_up/ffn_down tensors)")
    missing = [l for l, v in enumerate(layers) if v is None]
    if missing:
        raise ArgumentError(f"{os.path.basename(path)}: layers {missing[:8]} have no FFN tensors; "
                            "optiml solve needs an FFN in every layer")
    blk = 1
    for v in layers:
        blk = math.lcm(blk, v["block"])
    g = max(1, -(-int(group) // blk)) * blk
    ffn_names = {f"blk.{l}.{k}.weight" for l in range(n_layer) for k in _FFN}
    # What goes with a layer's attention (as the plan counts it): every tensor of the block but the FFN
    # matrices and their gate/up biases.
    fixed = fixed_layout(tensors, md, arch, n_layer,
                         lambda n: n in ffn_names or n.endswith(("ffn_gate.bias", "ffn_up.bias")))
    fixed["weights_fixed"] += sum(t.n_bytes for n, t in tensors.items() if n.endswith(("ffn_gate.bias", "ffn_up.bias")))
    # The device's scratch per token of a batch, as the plan counts it (plan.cpp scratch_bytes): four rows of
    # n_embd, two of n_head * k_len, two of n_head_kv * k_len, two of n_ff (floats).
    n_ff = max(v["n_ff"] for v in layers)
    scratch_per_token = 4 * (4 * fixed["n_embd"] + 2 * fixed["n_head"] * fixed["k_len"]
                             + 2 * fixed["n_head_kv"] * fixed["k_len"] + 2 * n_ff)
    return dict(fixed, n_layer=n_layer, layers=layers, group=g, kv_per_token=n_layer * fixed["kv_per_position"],
                scratch_per_token=scratch_per_token, metadata={k: v for k, v in md.items() if k.startswith("optiml.sparsity.")})


def _check_tokens(name: str, v, least: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
        raise ArgumentError(f"{name} must be a whole number of tokens >= {least}, not {v!r}")


def solve_placement(model_path, stats, vram: int, hardware: Hardware, ctx: int = 4096, group: int = 64,
                    time_limit: float = 30.0, mip_gap: float = MIP_GAP, method: str = "auto",
                    batch: int = 512, positions: int | None = None,
                    predictors: str | os.PathLike | None = None) -> Placement:
    """Places the FFN neurons of the model at model_path on the GPU within `vram` bytes (see the module doc).
    stats: an optiml.formats.stats.ActivationStats measured on this model. batch: the most tokens per step the model
    will run with (its n_batch), for the device's scratch. positions: the past tokens a decode step attends to,
    for the time its KV cache takes to read (default ctx // 2: the mean over a context filled from empty).
    predictors: the predictor file the model will run with (optiml train-predictors): the CPU's FFN share is
    timed as it runs with them. Warnings (SolveWarning) for an all-CPU placement, a time limit or the greedy
    fallback."""
    model_path = os.fspath(model_path)
    if isinstance(vram, bool) or not isinstance(vram, (int, np.integer)) or vram < 0:
        raise ArgumentError(f"the VRAM budget must be a whole number of bytes >= 0, not {vram!r}")
    _check_tokens("ctx", ctx)
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ArgumentError(f"group must be a whole number of neurons >= 1, not {group!r}")
    _check_tokens("batch", batch)
    positions = int(ctx) // 2 if positions is None else positions
    _check_tokens("positions", positions, 0)
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"model file not found: {model_path}")
    lay = _model_layout(model_path, group)  # first: a model with no FFN is the error to report
    stats.check_model(model_path)
    if lay["n_layer"] != stats.n_layer:
        raise ArgumentError(f"the model has {lay['n_layer']} layers, the stats {stats.n_layer}")
    for l, v in enumerate(lay["layers"]):
        if v["n_ff"] != stats.n_ff:
            raise ArgumentError(f"layer {l} of the model has n_ff {v['n_ff']}, the stats have {stats.n_ff} neurons")
    pred = predictor_costs(predictors, model_path, stats) if predictors is not None else None
    g = lay["group"]
    # The FFN groups' CPU time at the CPU's measured row-sparse rate for their type (when `optiml hw` measured
    # it); dense reads (attention, the output, what decides who fires) at its dense rate (time_model).
    ffn_hw = hardware.for_type(lay["layers"][0]["ffn_type"])
    mode = ffn_mode(stats.activation, lay["metadata"], pred is not None)
    order = hot_first_order(stats.freq, stats.impact)
    sorted_freq = [np.asarray(stats.freq[l], dtype=np.float64)[order[l]] for l in range(stats.n_layer)]
    # The placed file keeps its order (neuron_order) unless every down tensor can be permuted exactly; then a
    # split layer's device share holds its down as 8-bit neuron-major rows (plan.cpp ffn_share_bytes).
    permuted = all(down_permutable(v["down_type"], v["block"], order[l]) for l, v in enumerate(lay["layers"]))
    q8_row = -(-lay["n_embd"] // 32) * 34
    gbs, cbs = [], []
    groups = {"split_bytes": [], "cpu_fixed": []}  # solve_groups' per-layer extras
    for l, v in enumerate(lay["layers"]):
        fn = lambda n, v=v: n * v["row_bytes"] + (n // v["block"]) * v["col_block"]  # noqa: E731
        gb, _ = make_groups(sorted_freq[l], g, fn)
        assert int(gb.sum()) == v["total"], "group bytes must add up to the layer's FFN tensors"
        gbs.append(gb)
        cbs.append(neuron_cpu_bytes(sorted_freq[l], g, v, mode, hardware, ffn_hw, pred, l))
        groups["split_bytes"].append(None if permuted else (g * (v["row_bytes"] + q8_row), 4 * lay["n_embd"]))
        groups["cpu_fixed"].append((predictor_seconds(pred, l, hardware) if pred is not None else 0.0)
                                   + (dense_down_seconds(v, hardware) if mode == "dense" else 0.0))
    r = _place(lay, gbs, cbs, vram, hardware, ffn_hw, ctx, batch, positions, time_limit, mip_gap, method, groups)
    sol = r.sol
    k = [min(x * g, v["n_ff"]) for x, v in zip(sol.x, lay["layers"])]
    coverage = []
    for l, kl in enumerate(k):
        tot = float(sorted_freq[l].sum())
        coverage.append(float(sorted_freq[l][:kl].sum()) / tot if tot > 0 else float(kl == len(sorted_freq[l])))
    return Placement(gpu_neurons=k, group=g, coverage=coverage, ffn_bytes=[v["total"] for v in lay["layers"]],
                     gpu_ffn_bytes=[int(layer_bytes(gb, sp)[0][x]) for gb, sp, x in zip(gbs, groups["split_bytes"], sol.x)],
                     predictors=os.path.basename(os.fspath(predictors)) if predictors is not None else "",
                     **r.fields(vram, ctx, positions, hardware))


class _Placed(NamedTuple):
    """_place's answer: the groups' solution and where the fixed part goes, what it takes and the estimates."""
    sol: GroupSolution
    attention: list[bool]
    output: bool
    used: int
    est: float
    fixed: int
    times: FixedTimes
    cpu_ffn: float
    kv: int       # bytes of KV cache placed
    scratch: int  # bytes of the device's scratch placed

    def fields(self, vram, ctx, positions, hardware) -> dict:
        """The Placement fields that neurons and experts share."""
        s = self.sol
        return dict(vram_budget=int(vram), vram_used=int(self.used), fixed_bytes=int(self.fixed), ctx=int(ctx),
                    hardware=hardware.to_dict(), est_token_s=float(self.est), method=s.method, status=s.status,
                    gap=float(s.gap), solve_s=s.solve_s, gpu_attention=self.attention, output_on_gpu=self.output,
                    positions=int(positions), cpu_only_parts=self.times.cpu_parts(self.cpu_ffn),
                    used_parts={"scratch": int(self.scratch), "kv_cache": int(self.kv),
                                "weights": int(self.used) - int(self.scratch) - int(self.kv) - int(s.ffn_bytes),
                                "ffn": int(s.ffn_bytes)},
                    cpu_only_token_s=self.times.estimate(self.cpu_ffn, [False] * len(self.attention), False))


def _place(lay, gbs, cbs, vram, hardware, ffn_hw, ctx, batch, positions, time_limit, mip_gap, method,
           groups: dict | None = None) -> _Placed:
    """The fixed part (weights, KV cache for ctx, the scratch for steps of `batch` tokens and the logits rows,
    as the plan counts them) and the FFN groups within vram: every layer's attention on the GPU when the fixed
    part fits, else _solve_partial_attention's choice, else all on the CPU (a SolveWarning says why).
    gbs, cbs, groups: solve_groups' inputs; ffn_hw times the groups, hardware the rest."""
    L = lay["n_layer"]
    steps = min(int(batch), int(ctx))  # the plan's n_batch: a step holds at most the context
    times = fixed_times(lay, hardware, int(positions), min(steps, 64))
    scratch = lay["scratch_per_token"] * steps
    logits = times.output_bytes - sum(lay["output_types"].values())  # the rows the plan keeps beside the output
    fixed = lay["weights_fixed"] + lay["kv_per_token"] * int(ctx) + scratch + logits
    groups = groups or {}
    cpu_ffn = float(sum(layer_times(gb, cb, ffn_hw, cpu_fixed=f)[0]
                        for gb, cb, f in zip(gbs, cbs, groups.get("cpu_fixed") or [0.0] * L)))
    cpu_only = times.estimate(cpu_ffn, [False] * L, False)
    t0 = time.perf_counter()
    if fixed > vram:
        sol, attention, output, used, est = _solve_partial_attention(
            lay, gbs, cbs, int(vram) - scratch, ffn_hw, times, int(ctx), time_limit, mip_gap, method, cpu_only,
            groups)
        if isinstance(sol, str):  # why nothing goes to the GPU
            warnings.warn(f"the budget of {vram:,} bytes: {sol}; everything stays on the CPU", SolveWarning,
                          stacklevel=3)
            sol = GroupSolution(x=[0] * L, objective_s=cpu_ffn, ffn_bytes=0, method="all-cpu",
                                status=f"all-cpu: {sol} (the whole fixed part takes {fixed:,} bytes)", gap=math.nan,
                                solve_s=time.perf_counter() - t0)
            used, est, attention, output, kv, scratch = 0, cpu_only, [False] * L, False, 0, 0
        else:
            used += scratch
            kv = lay["kv_per_token"] * int(ctx) // L * sum(attention)  # (as _solve_partial_attention counts it)
    else:
        # Every layer's attention is on the GPU: a layer pays the transfer unless its whole FFN is there too.
        sol = solve_groups(gbs, cbs, vram - fixed, ffn_hw, time_limit, mip_gap, method, attention=["gpu"] * L,
                           **groups)
        used, attention, output = fixed + sol.ffn_bytes, [True] * L, True
        kv = lay["kv_per_token"] * int(ctx)
        est = times.estimate(sol.objective_s, attention, output)
    return _Placed(sol, attention, output, used, est, fixed, times, cpu_ffn, kv, scratch)


def _solve_partial_attention(lay, gbs, cbs, vram, ffn_hw, times: FixedTimes, ctx, time_limit, mip_gap, method,
                             all_cpu_s, groups: dict | None = None):
    """When the fixed part does not fit: attention and KV cache on the GPU for the last m layers only, the
    output matrix there too when chosen (it follows the last layer's attention, as the plan places it), FFN
    groups anywhere. Every (m, output) that fits is scored with the greedy FFN placement (each layer's split
    cost following where its attention runs, layer_times), then the best and its neighbours are solved
    exactly. m = 0 (FFN neurons only) is a candidate too. The FFN groups are timed with ffn_hw, the rest
    by `times`. vram: the budget less the device's scratch. groups: solve_groups' split_bytes and cpu_fixed.
    Returns (GroupSolution, attention per layer, output on the GPU, bytes placed less the scratch, estimated
    s/token), or (why, None, None, None, None) when nothing goes to the GPU."""
    L = lay["n_layer"]
    kv = lay["kv_per_token"] * ctx // L
    att_b = [a + kv for a in lay["attn"]]

    def need(m, out):
        return sum(att_b[L - m:]) + (times.output_bytes if out else 0)

    def score(m, out, how, limit=time_limit):
        on = [l >= L - m for l in range(L)]
        with warnings.catch_warnings():  # (the search says once, below, what its solves warned of)
            warnings.simplefilter("ignore", SolveWarning)
            sol = solve_groups(gbs, cbs, vram - need(m, out), ffn_hw, limit, mip_gap, how,
                               attention=["gpu" if a else "cpu" for a in on], **(groups or {}))
        # The residual crosses to the device before layer L - m, and back for the output when it stays here.
        crossings = (0 < m < L) + (m > 0 and not out)
        return times.estimate(sol.objective_s, on, out) + crossings * times.crossing_s, sol

    if vram <= 0:
        return "it does not hold the device's scratch", None, None, None, None
    t0 = time.perf_counter()
    # The whole search keeps to time_limit (what --time-limit promises), not each of its up to four programs:
    # each gets an even share of what is left, so time one does not use goes to the next.
    deadline = t0 + time_limit
    fits = [(m, out) for m in range(L + 1) for out in ((False, True) if m else (False,)) if need(m, out) <= vram]
    greedy = {c: score(*c, "greedy") for c in fits}
    best_c = min(greedy, key=lambda c: greedy[c][0])
    best = (best_c, *greedy[best_c])
    stopped, no_solution = 0, 0
    if method != "greedy":
        m0, out0 = best_c
        cands = sorted({(m0 - 1, out0), (m0, out0), (m0 + 1, out0), (m0, not out0)} & set(fits))
        for i, c in enumerate(cands):
            limit = max((deadline - time.perf_counter()) / (len(cands) - i), 1e-3)
            est, sol = score(*c, method, limit)
            stopped += sol.status == "Time limit reached"
            no_solution += sol.status.startswith("greedy: HiGHS found no solution")
            if est <= best[1] * (1 + 1e-12):  # the program's answer, also when it only confirms greedy's
                best = (c, est, sol)
        if stopped:
            warnings.warn(f"HiGHS stopped at its time limit in {stopped} of the {len(cands)} programs of the search "
                          f"over how many layers' attention go to the GPU ({time_limit:g} s for all of them); using "
                          "the best solution found (at least as good as greedy)", SolveWarning, stacklevel=4)
        if no_solution:
            warnings.warn(f"HiGHS found no solution in {no_solution} of the {len(cands)} programs of the search over "
                          "how many layers' attention go to the GPU; greedy placed those", SolveWarning, stacklevel=4)
    (m, out), est, sol = best
    if est >= all_cpu_s or (m == 0 and sol.ffn_bytes == 0):
        return "nothing that fits beside the scratch pays for its transfers", None, None, None, None
    sol.solve_s = time.perf_counter() - t0  # the whole search's time, not only its chosen program's
    # (the status is recorded in the placed file, where optiml info shows it)
    held = _layers(range(L - m, L)) + (" and the output matrix" if out else "")
    sol.status += (f"; the GPU holds the attention of {held} (not every layer's: the budget is below the fixed part)"
                   if m else "; the GPU holds no layer's attention (the budget is below the fixed part)")
    return sol, [l >= L - m for l in range(L)], out, need(m, out) + sol.ffn_bytes, est


def format_report(p: Placement) -> str:
    """A compact human-readable summary of a placement."""
    n_ff = [fb for fb in p.ffn_bytes]
    total_ffn = sum(n_ff)
    gpu_ffn = sum(p.gpu_ffn_bytes)
    gap = "n/a" if math.isnan(p.gap) else f"{p.gap:.2e}"
    lines = [
        f"solver: {p.method}, status {p.status}, gap {gap}, {p.solve_s:.2f} s",
        f"hardware ({p.hardware.get('source', '?')}): CPU {p.hardware['cpu_bandwidth'] / 1e9:.1f} GB/s, "
        f"GPU {p.hardware['gpu_bandwidth'] / 1e9:.1f} GB/s, split cost "
        f"{(p.hardware['transfer_latency'] + p.hardware['sync_cost']) * 1e6:.1f} us"
        + "".join(f", CPU {t.upper()} rows {v / 1e9:.1f} GB/s" for t, v in p.hardware.get("cpu_sparse", {}).items())
        + (f", down rows {p.hardware['cpu_sparse_down'] / 1e9:.1f} GB/s" if p.hardware.get("cpu_sparse_down") else ""),
        f"VRAM: {mib(p.vram_used)} used of {mib(p.vram_budget)}" + _used_parts(p),
        f"{'experts' if p.gpu_experts else 'FFN'}: {mib(gpu_ffn)} on the GPU, {mib(total_ffn - gpu_ffn)} on the CPU "
        f"({gpu_ffn / total_ffn if total_ffn else 0:.1%} of {'expert' if p.gpu_experts else 'FFN'} bytes)"
        + ("" if p.gpu_experts else f", group {p.group} neurons"),
    ]
    cov = np.asarray(p.coverage)
    if len(cov):
        lines.append(f"{'routings' if p.gpu_experts else 'firings'} covered by the GPU: mean {cov.mean():.1%}, "
                     f"min {cov.min():.1%}, max {cov.max():.1%}")
    if p.gpu_experts:
        lines.append("experts on the GPU per layer: " + " ".join(str(len(e)) for e in p.gpu_experts))
    else:
        lines.append("k per layer: " + " ".join(str(k) for k in p.gpu_neurons))
    if p.fixed_bytes > p.vram_budget:
        lines.append(attention_line(p.gpu_attention, p.output_on_gpu, p.fixed_bytes, p.ctx, p.method == "all-cpu",
                                    "experts" if p.gpu_experts else "FFN neurons"))
    ratio = p.cpu_only_token_s / p.est_token_s if p.est_token_s > 0 else math.nan
    parts = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in p.cpu_only_parts.items())
    lines.append(f"estimated {p.est_token_s * 1e3:.3f} ms/token GPU+CPU vs {p.cpu_only_token_s * 1e3:.3f} ms/token "
                 f"all-CPU ({ratio:.2f}x; all-CPU by part: {parts} ms; decode steps attending to {p.positions} "
                 f"positions{', with ' + p.predictors if p.predictors else ''})")
    return "\n".join(lines)


def _used_parts(p: Placement) -> str:
    """': scratch ..., KV cache ..., ...' for the VRAM line, when the placement knows its parts."""
    u = p.used_parts
    if not u or not p.vram_used:
        return ""
    return (f": scratch {mib(u['scratch'])}, KV cache (ctx {p.ctx}) {mib(u['kv_cache'])}, "
            f"{'attention, norms, routers and output' if p.gpu_experts else 'attention, norms and output'} "
            f"{mib(u['weights'])}, {'experts' if p.gpu_experts else 'FFN neurons'} {mib(u['ffn'])}")


def attention_line(gpu_attention: Sequence, output_on_gpu: bool, fixed_bytes: int, ctx: int, all_cpu: bool,
                   units: str = "FFN neurons") -> str:
    """What a budget below the fixed part placed, in words (the report's and optiml info's line). units: what
    else goes to the GPU ("experts" for a mixture of experts)."""
    on = [l for l, a in enumerate(gpu_attention) if a]
    head = (f"the budget cannot hold every layer's attention (all of it with the KV cache for ctx {ctx}, the norms, "
            f"the output and the scratch take {mib(fixed_bytes)}), so ")
    if all_cpu:
        return head + "everything stays on the CPU"
    if not on:
        return head + f"no layer's attention is on the GPU, only {units}; the output matrix on the CPU"
    return (head + f"the attention (and KV cache) of {len(on)} of {len(gpu_attention)} layers is on the GPU: "
            f"{_layers(on)}; the output matrix on the {'GPU' if output_on_gpu else 'CPU'}")


def _layers(ids: Sequence[int]) -> str:
    """Consecutive layers in words: "layer 29", "layers 27-29"."""
    return f"layer {ids[0]}" if len(ids) == 1 else f"layers {ids[0]}-{ids[-1]}"


def _silent_highs(highspy):
    """A Highs with its output off. Making one prints HiGHS's banner on the process's stdout from C++, before
    any option can turn it off, where it would land among optiml solve's report: stdout points at /dev/null
    while it is made (the C library's buffer flushed before it is put back). Process-wide: another thread's
    output in that moment would be lost too."""
    def flush_c_stdio():
        try:
            ctypes.CDLL(None).fflush(None)
        except (OSError, AttributeError, TypeError):  # (no C library to flush by name: Windows)
            pass

    sys.stdout.flush()
    flush_c_stdio()  # (what the C side printed before goes where it was meant to)
    try:
        saved = os.dup(1)
    except OSError:  # (no stdout to hide it from)
        saved = None
    if saved is not None:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, 1)
                h = highspy.Highs()
                flush_c_stdio()
            finally:
                os.dup2(saved, 1)
                os.close(null)
        finally:
            os.close(saved)
    else:
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h
