"""Neurons that fire together, side by side: an order of a layer's FFN neurons in which co-active neurons
are neighbours, so that a sparse step reads fewer, longer runs of rows (`optiml solve --order coactive`).

The data are the firing masks of sampled tokens that `optiml profile --samples N` keeps (a bounded sample:
N tokens x n_ff bits per layer). From them, per layer:

1. C[i, j] = the correlation of neurons i and j's firing over the sampled tokens (the phi coefficient),
   computed block by block as a product of the standardized masks, keeping each neuron's `neighbours`
   largest entries only (memory n x neighbours). Correlation, not the count of joint firings: counts
   favour the hottest neurons, which fire beside everything, and on a model with planted clusters of 32
   they kept 17-36% of adjacent pairs inside a cluster where correlation keeps 96%.
2. A greedy chain: start from the most frequent neuron; repeatedly step to the neighbour of the chain's
   end with the largest positive C among those not yet placed; when none is left, start again from the
   most frequent neuron not yet placed. Adjacent pairs then tend to fire together, which is what a read of
   consecutive rows rewards (a Hamiltonian path problem, solved the nearest-neighbour way).

The order is exact: permuting a layer's neurons does not change its function. `run_lengths` measures what
it buys: the mean length of the runs of consecutive active rows a step reads.
"""

from __future__ import annotations

import warnings

import numpy as np

from .._core import ArgumentError

__all__ = ["check_stats", "coactive_order", "placed_order", "run_lengths", "unpack_masks"]


def unpack_masks(packed: np.ndarray, n_ff: int) -> np.ndarray:
    """A layer's sample_mask ([S, ceil(n_ff / 8)] bytes, np.packbits over neurons) as bool [S, n_ff]."""
    return np.unpackbits(packed, axis=-1, count=n_ff).astype(bool)


def _top_neighbours(m: np.ndarray, k: int, block: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """For each column of m ([S, n] float32 0/1), the k other columns most correlated with it over the
    samples, and the correlations, largest first: int32 [n, k], float32 [n, k]."""
    s, n = m.shape
    k = min(k, n - 1)
    p = m.mean(axis=0)
    z = (m - p) / np.sqrt(np.maximum(p * (1 - p), 1e-12))  # standardized: a never- or always-firing neuron is 0
    zt = np.ascontiguousarray(z.T)
    ids = np.empty((n, k), dtype=np.int32)
    corr = np.empty((n, k), dtype=np.float32)
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        c = (zt[b0:b1] @ z) / np.float32(s)  # [b, n] correlations
        c[np.arange(b1 - b0), np.arange(b0, b1)] = -np.inf  # not itself
        part = np.argpartition(-c, k - 1, axis=1)[:, :k]
        vals = np.take_along_axis(c, part, axis=1)
        by = np.argsort(-vals, axis=1, kind="stable")
        ids[b0:b1] = np.take_along_axis(part, by, axis=1)
        corr[b0:b1] = np.take_along_axis(vals, by, axis=1)
    return ids, corr


def coactive_order(masks: np.ndarray, neurons: np.ndarray | None = None, neighbours: int = 64) -> np.ndarray:
    """An order of `neurons` (ids into the masks' columns; default all) with co-active ones adjacent.
    masks: bool [S, n_ff], the firing of S sampled tokens. Returns the ids reordered (int64)."""
    masks = np.asarray(masks)
    if masks.ndim != 2 or masks.shape[0] == 0:
        raise ArgumentError("co-activation order: the stats hold no sampled firing masks (profile with --samples N)")
    neurons = np.arange(masks.shape[1]) if neurons is None else np.asarray(neurons, dtype=np.int64)
    n = len(neurons)
    if n <= 2:
        return neurons.copy()
    m = masks[:, neurons].astype(np.float32)
    freq = m.sum(axis=0)
    ids, corr = _top_neighbours(m, neighbours)
    by_freq = np.lexsort((np.arange(n), -freq))  # restarts: the most frequent first
    placed = np.zeros(n, dtype=bool)
    out = np.empty(n, dtype=np.int64)
    next_start = 0
    cur = -1
    for pos in range(n):
        nxt = -1
        if cur >= 0:
            for j, c in zip(ids[cur], corr[cur]):
                if c <= 0:
                    break
                if not placed[j]:
                    nxt = int(j)
                    break
        if nxt < 0:
            while placed[by_freq[next_start]]:
                next_start += 1
            nxt = int(by_freq[next_start])
        placed[nxt] = True
        out[pos] = nxt
        cur = nxt
    return neurons[out]


def run_lengths(masks: np.ndarray, order: np.ndarray) -> float:
    """The mean length of the runs of consecutive active rows over the sampled tokens when a layer's rows
    are stored in `order` (ids into the masks' columns): the rows a sparse step reads, per run."""
    a = np.asarray(masks)[:, np.asarray(order)].astype(np.int8)
    active = int(a.sum())
    if active == 0:
        return 0.0
    starts = int((np.diff(a, axis=1, prepend=0) == 1).sum())
    return active / starts


def check_stats(stats, where: str = "the stats", warn: bool = True) -> None:
    """ArgumentError unless the stats can order neurons: a dense FFN's, with enough sampled firing masks;
    a warning (with warn) when they are fewer than an order needs to pay."""
    if stats.is_moe:
        raise ArgumentError("--order coactive orders FFN neurons; a mixture of experts is placed by whole experts")
    if stats.sample_mask is None:
        raise ArgumentError(f"--order coactive needs the firing masks of sampled tokens, which {where} does not "
                            "hold: profile with --samples N (e.g. 2048)")
    n = stats.sample_mask.shape[1]
    if n < 4:
        raise ArgumentError(f"--order coactive: {n} sampled tokens are too few; profile with --samples 1024 or more")
    if n < 1024 and warn:
        warnings.warn(f"--order coactive on {n} sampled tokens (half to order by, half to measure the order on): "
                      "with fewer than 1024 the order can read shorter runs than hot-first; profile with --samples "
                      "1024 or more", stacklevel=2)


def placed_order(stats, gpu_neurons, neighbours: int = 64, progress=None) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Each layer's placed order: its GPU share (gpu_neurons[l] neurons) the hot-first prefix as the solver
    chose it, the CPU's neurons after it in co-activation order. Returns the order [n_layer, n_ff] and per
    layer the mean run length of active CPU rows before (hot-first) and after, measured on the sampled
    tokens the order was not made from (every other one)."""
    from ..formats.stats import hot_first_order

    check_stats(stats)
    L, F = stats.freq.shape
    hot = hot_first_order(stats.freq, stats.impact)
    order = hot.copy()
    runs = []
    for l in range(L):
        masks = unpack_masks(stats.sample_mask[l], F)
        fit, held = masks[0::2], masks[1::2]
        k = int(gpu_neurons[l]) if gpu_neurons is not None and len(gpu_neurons) else 0
        order[l, k:] = coactive_order(fit, hot[l, k:], neighbours)
        runs.append((run_lengths(held, hot[l, k:]), run_lengths(held, order[l, k:])))
        if progress:
            progress(l)
    return order, runs
