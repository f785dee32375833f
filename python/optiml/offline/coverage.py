"""The figure of `optiml info --plot`: how often each FFN neuron fires against its rank (a power law), and
the share of firings that the hottest neurons cover (optiml.formats.placement's curves), each layer's GPU
share marked when the file is placed. Needs matplotlib (pip install optiml[plot])."""

from __future__ import annotations

import os

import numpy as np

from .._core import ArgumentError
from ..util.atomic import atomic_output

__all__ = ["plot"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ArgumentError('plots need matplotlib: pip install "optiml[plot]" (or: pip install matplotlib)') from None
    return plt


def plot(png: str | os.PathLike, ranks: np.ndarray, freq: np.ndarray, coverage: np.ndarray, n_ff: int,
         gpu_neurons=None, title: str = "", unit: str = "neuron") -> None:
    """Two panels: firing frequency vs neuron rank (log-log; a few layers and the mean) and the share of
    firings covered vs the share of neurons on the GPU (each layer's k_l marked when given).
    ranks: 1-based ranks [P]; freq, coverage: [L, P] at those ranks. unit "expert": a mixture of experts'
    routings (freq: the share of tokens routed to each expert)."""
    fires = "fires" if unit == "neuron" else "is routed"
    plt = _pyplot()
    ranks = np.asarray(ranks)
    freq, coverage = np.asarray(freq, dtype=np.float64), np.asarray(coverage, dtype=np.float64)
    L = freq.shape[0]
    shown = sorted({0, L // 4, L // 2, (3 * L) // 4, L - 1})
    cmap = plt.get_cmap("viridis")
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))

    for l in shown:
        a.loglog(ranks, np.maximum(freq[l], 1e-6), color=cmap(l / max(L - 1, 1)), lw=1.2, label=f"layer {l}")
    a.loglog(ranks, np.maximum(freq.mean(axis=0), 1e-6), color="crimson", lw=2.4, ls="--", label="mean of all layers")
    a.set_xlabel(f"{unit} rank (most frequent first)")
    a.set_ylabel(f"share of tokens on which it {fires}")
    a.set_title("activation frequency (power law)")
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=8)

    share = ranks / n_ff
    for l in range(L):
        b.plot(share, coverage[l], color=cmap(l / max(L - 1, 1)), lw=0.8, alpha=0.6)
    b.plot(share, coverage.mean(axis=0), color="crimson", lw=2.4, ls="--", label="mean of all layers")
    b.plot([0, 1], [0, 1], color="gray", lw=0.8, ls=":", label="no locality (uniform)")
    if gpu_neurons is not None:
        ks = np.asarray(gpu_neurons, dtype=np.float64)
        covk = [np.interp(k, np.concatenate([[0], ranks]), np.concatenate([[0], coverage[l]])) for l, k in enumerate(ks)]
        b.scatter(ks / n_ff, covk, c=[cmap(l / max(L - 1, 1)) for l in range(L)], s=22, edgecolors="k",
                  linewidths=0.5, zorder=3, label="k_l: each layer's GPU share")
    b.set_xlim(0, 1)
    b.set_ylim(0, 1.02)
    b.set_xlabel(f"share of the layer's {unit}s on the GPU (hot first)")
    b.set_ylabel("share of firings they cover" if unit == "neuron" else "share of routings they cover")
    b.set_title("coverage (color: layer, dark = first)")
    b.grid(True, alpha=0.3)
    b.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        with atomic_output(png, suffix=".png") as tmp:  # matplotlib picks the format by extension
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
