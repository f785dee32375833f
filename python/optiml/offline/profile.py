"""`optiml profile`: run a model over sample text and record, per layer and per FFN neuron, how often it
fires and how much it contributes; for a mixture of experts, which experts the router chooses (alone and
after the token before) and how often the neurons inside each fire (optiml.formats.stats describes the
result).

    stats = optiml.profile("model.gguf", ["wiki.txt", "chats.jsonl"], n_tokens=20000, out="model.stats.npz")

The engine does the work: a native recorder attached to the session sees every FFN activation as the
text runs through in context-length chunks (each from an empty context). This module reads the data,
drives the chunks and shows progress.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Sequence

import numpy as np

from .. import _core
from .._core import ArgumentError
from ..engine.model import Model
from ..formats.stats import ActivationStats, model_fingerprint, save

__all__ = ["profile", "read_texts", "layer_quantiles", "token_chunks", "run_chunks", "coverage_of_top"]

# For SiLU/GELU models a neuron "fires" when its |activation| is in the top share of its layer's values
# on the first chunk (ReLU-family: when it is above zero).
DEFAULT_ACTIVE_SHARE = 0.5


def read_texts(paths: Sequence[str | os.PathLike], field: str = "text") -> list[str]:
    """The documents in plain text files (one document per file) and JSONL files (one per line, the
    `field` of each object). A file is JSONL when its name ends in .jsonl or its first line is a JSON object."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ArgumentError("no data files given")
    docs = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            raise ArgumentError(f"{p} is a folder: give text or JSONL files (the files in it by name)")
        if not os.path.isfile(p):
            raise FileNotFoundError(f"data file not found: {p}")
        with open(p, encoding="utf-8", errors="replace") as f:
            text = f.read()
        first = text.lstrip()[:1]
        if p.endswith(".jsonl") or first == "{":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ArgumentError(f"{p}:{n}: not a JSON line ({e.msg})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                    raise ArgumentError(f"{p}:{n}: expected an object with a string field {field!r} (--field)")
                docs.append(obj[field])
        else:
            docs.append(text)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ArgumentError(f"no text in {', '.join(map(str, paths))}")
    return docs


def layer_quantiles(hist: np.ndarray, edges: np.ndarray, share_below: float | np.ndarray) -> np.ndarray:
    """Per layer, the value below which `share_below` of the histogram's mass lies (linear inside a bin).
    hist: [L, B] counts over bins with the given edges [B+1]."""
    L = hist.shape[0]
    q = np.broadcast_to(np.asarray(share_below, dtype=np.float64), (L,))
    out = np.zeros(L, dtype=np.float32)
    for l in range(L):
        total = hist[l].sum()
        if total <= 0 or q[l] <= 0:
            continue
        cum = np.cumsum(hist[l]) / total
        b = int(np.searchsorted(cum, q[l]))  # first bin whose cumulative share reaches q
        b = min(b, hist.shape[1] - 1)
        lo_share = cum[b - 1] if b > 0 else 0.0
        frac = (q[l] - lo_share) / max(cum[b] - lo_share, 1e-300)
        hi = edges[b + 1] if np.isfinite(edges[b + 1]) else edges[b] * 2
        out[l] = edges[b] + min(max(frac, 0.0), 1.0) * (hi - edges[b])
    return out


def token_chunks(model, docs: list[str], n_ctx: int, n_tokens: int) -> list[list[int]]:
    """The first n_tokens tokens of the documents (each with its BOS) in chunks of n_ctx."""
    ids: list[int] = []
    for d in docs:
        ids.extend(model.tokenize(d, add_bos=True))
        if len(ids) >= n_tokens:
            break
    ids = ids[:n_tokens]
    if not ids:
        raise ArgumentError("the data has no tokens")
    return [ids[i:i + n_ctx] for i in range(0, len(ids), n_ctx)]


def run_chunks(model, chunks, recorder, progress: bool = False, desc: str = "") -> None:
    """Runs every chunk (each from an empty context) with `recorder` attached; a progress bar on stderr
    in tokens when `progress`."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(c) for c in chunks), unit="tok", desc=desc, file=sys.stderr, dynamic_ncols=True)
    sess = model._session
    sess.set_recorder(recorder)
    try:
        for c in chunks:
            model.reset()
            model.eval(c)
            if bar is not None:
                bar.update(len(c))
    finally:
        sess.set_recorder(None)
        model.reset()
        if bar is not None:
            bar.close()


def profile(
    model,
    data: Sequence[str | os.PathLike] | str | os.PathLike,
    n_tokens: int = 20000,
    out: str | os.PathLike | None = None,
    n_ctx: int = 512,
    threshold: float | None = None,
    active_share: float | None = None,
    samples: int = 0,
    field: str = "text",
    n_threads: int | None = None,
    progress: bool = True,
    texts: list[str] | None = None,
    gate_weight: np.ndarray | None = None,
) -> ActivationStats:
    """Profiles `model` (a path or an optiml.Model) on up to n_tokens tokens of `data` (files: plain text
    or JSONL with a `field`; or pass `texts`, a list of strings, instead). A neuron fires when
    |act(gate) * up| > threshold: 0 for ReLU-family models; for others the given `threshold`, or per layer
    the value that `active_share` (default 0.5) of the first chunk's activations exceed. samples > 0 keeps
    the FFN inputs and firing masks of that many tokens, spread over the data. gate_weight ([L, F]) makes
    the gate histogram count |act(gate)| * gate_weight (optiml.calibrate's weighted criterion). Writes
    `out` when given."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens <= 0:
        raise ArgumentError(f"n_tokens must be a positive integer, got {n_tokens!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ArgumentError(f"samples must be a non-negative integer, got {samples!r}")
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0:
        raise ArgumentError(f"n_ctx must be a positive integer, got {n_ctx!r}")
    if threshold is not None and not (np.isfinite(threshold) and threshold >= 0):
        raise ArgumentError(f"threshold must be finite and >= 0, got {threshold}")
    if active_share is not None and not 0 < active_share <= 1:
        raise ArgumentError(f"active_share must be in (0, 1], got {active_share}")
    if threshold is not None and active_share is not None:
        raise ArgumentError("give a threshold or an active share, not both")
    if out is not None:
        folder = os.path.dirname(os.path.abspath(os.fspath(out)))
        if not os.path.isdir(folder):
            raise ArgumentError(f"{out}: the output folder {folder} does not exist")
    docs = texts if texts is not None else read_texts(data, field)
    own = not isinstance(model, Model)
    # Dense and without predictors (not even ones beside the model): the stats are of every neuron's own firing.
    m = Model(model, n_ctx=n_ctx, n_threads=n_threads, sparsity="none", predictors=None) if own else model
    try:
        hp = m.hparams
        moe = hp["n_expert"] > 0
        if hp["n_ff"] <= 0 and not moe:
            raise ArgumentError(f"{m.path}: the model has no FFN neurons to profile")
        if moe and samples:
            raise ArgumentError(f"{m.path}: a mixture of experts keeps no samples (activation predictors do not "
                                "handle experts yet); profile it with samples=0")
        n_ctx = min(n_ctx, m.n_ctx)
        chunks = token_chunks(m, docs, n_ctx, n_tokens)
        L = hp["n_layer"]
        relu = hp["ffn_act"] in ("relu", "relu2")
        if relu and threshold is None:
            thr = np.zeros(L, dtype=np.float32)
        elif threshold is not None:
            thr = np.full(L, threshold, dtype=np.float32)
        else:  # a first look at the first chunk sets each layer's threshold
            probe = _core.ActivationRecorder(m._model, np.zeros(L, dtype=np.float32))
            run_chunks(m, chunks[:1], probe)
            r = probe.result()
            thr = layer_quantiles(r["prod_hist"], r["hist_edges"], 1.0 - (active_share or DEFAULT_ACTIVE_SHARE))
        total = sum(len(c) for c in chunks)
        every = max(1, total // samples) if samples else 0
        gw = None if gate_weight is None else np.ascontiguousarray(gate_weight, dtype=np.float32).reshape(-1)
        rec = _core.ActivationRecorder(m._model, thr, every, samples, gw)
        run_chunks(m, chunks, rec, progress, "profile")
        r = rec.result()
        n = max(1, int(r["n_tokens"]))
        mean_abs = (r["sum_abs"] / n).astype(np.float32)
        stats = ActivationStats(
            fingerprint=model_fingerprint(m.path),
            model=os.path.basename(m.path),
            activation=hp["ffn_act"],
            n_tokens=int(r["n_tokens"]),
            sources="\n".join(os.fspath(p) for p in ([] if texts is not None else
                                                      ([data] if isinstance(data, (str, os.PathLike)) else data))),
            threshold=r["threshold"],
            freq=(r["fired"] / n).astype(np.float32),
            mean_abs=mean_abs,
            mean_abs_up=(r["sum_abs_up"] / n).astype(np.float32),
            down_norm=r["down_norm"],
            impact=(mean_abs * r["down_norm"]).astype(np.float32),
            hist_edges=r["hist_edges"],
            gate_hist=r["gate_hist"],
            gate_err=r["gate_err"],
            prod_hist=r["prod_hist"],
            prod_err=r["prod_err"],
        )
        if samples:
            stats.sample_x = np.ascontiguousarray(r["sample_x"].view(np.float16).transpose(1, 0, 2))
            stats.sample_mask = np.ascontiguousarray(r["sample_mask"].transpose(1, 0, 2))
            if stats.sample_mask.shape[1] < samples:
                warnings.warn(f"kept {stats.sample_mask.shape[1]} of the {samples} samples asked for: the data gave "
                              f"{total} tokens (raise n_tokens, or give more text)", stacklevel=2)
        if moe:
            stats.expert_count = r["expert_count"]
            stats.expert_weight = r["expert_weight"]
            stats.expert_next = r["expert_next"]
            stats.expert_freq = (r["expert_fired"] / np.maximum(r["expert_count"], 1)[:, :, None]).astype(np.float32)
        if out is not None:
            save(stats, out)
        return stats
    finally:
        if own:
            m.close()


def coverage_of_top(stats: ActivationStats, share: float) -> float:
    """The share of all firings that the top `share` of each layer's neurons (by frequency) account for."""
    f = np.sort(stats.freq, axis=1)[:, ::-1]
    k = max(1, int(round(share * stats.n_ff)))
    total = f.sum()
    return float(f[:, :k].sum() / total) if total > 0 else 0.0
