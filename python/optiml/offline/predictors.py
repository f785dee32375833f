"""`optiml train-predictors`: per layer a small low-rank predictor of which FFN neurons will fire, so the
sparse FFN computes gate, up and down for those alone (DejaVu/PowerInfer's idea; trained here from scratch).

    optiml.train_predictors("model.gguf", ["train.txt"], recall=0.99, out="model.predictors.gguf")
    optiml.Model("model.gguf")                      # finds model.predictors.gguf beside it
    optiml.Model("model.gguf", predictors="p.gguf")  # or any file trained for this model

The predictor of layer l scores neuron j as (B (A x))[j] + bias[j] for the FFN input x (after its norm), A
[rank x n_embd], B [n_ff x rank], and predicts it active above a per-layer threshold.

Training. The profiler's recorder keeps FFN inputs and firing masks of sample tokens; a neuron fires by the
model's own criterion: act(gate) * up != 0 for ReLU models, |act(gate) * up| above the sparse FFN's
calibrated threshold for SwiGLU/GeGLU models (the file's `optiml calibrate` thresholds, or those that make a
share `label_sparsity` of neurons inactive). The score approximates the gate's pre-activation: A, B are the
best rank-r factorization of the gate over the sample inputs (G = X W_gate^T ~ X A^T B^T with B the top-r
right singular vectors of G, by a randomized SVD), a closed form that needs neither torch nor epochs. Per
layer, every rank of a grid is tried on held-out tokens: the threshold that keeps the recall target, then
the bytes a token reads (predictor + the predicted neurons' gate, up and down rows); the cheapest wins.
The threshold is set on held-out tokens for a recall of 1 - (1 - recall) / 2, a margin for new text.

Storage: a companion GGUF (optiml.formats.predictors), tied to the model by its fingerprint.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .. import _core
from .._core import ArgumentError
from ..engine.loading import model_file
from ..engine.model import Model
from ..formats import gguf, quant
from ..formats.predictors import check_predictors
from ..formats.predictors import write as write_predictors
from ..formats.stats import model_fingerprint
from ..util.atomic import check_new_output
from .profile import layer_quantiles, read_texts, run_chunks, token_chunks

__all__ = ["train_predictors", "PredictorTraining", "mask_quality"]

_OVERSAMPLE = 16
_POWER_ITERS = 1


@dataclass
class PredictorTraining:
    """What training found, per layer: the rank chosen, the decision threshold, and on the held-out tokens
    the recall and the share of neurons predicted active (and the share truly active)."""

    rank: np.ndarray
    threshold: np.ndarray
    recall: np.ndarray
    predicted: np.ndarray
    active: np.ndarray
    label_threshold: np.ndarray
    recall_target: float
    n_samples: int
    qtype: str
    out: str | None = None
    seconds: dict = field(default_factory=dict)
    activation: str | None = None  # the model's FFN activation (break_even_share)

    def table(self) -> str:
        lines = ["layer  rank  recall  predicted  active"]
        for l in range(len(self.rank)):
            lines.append(f"{l:5d} {int(self.rank[l]):5d}  {self.recall[l]:.4f}  {self.predicted[l]:9.3f}  "
                         f"{self.active[l]:6.3f}")
        return "\n".join(lines)


def _label_thresholds(m, chunks, label_sparsity):
    """Per layer, the |act(gate) * up| above which a neuron counts as firing."""
    hp = m.hparams
    L = hp["n_layer"]
    if hp["ffn_act"] in ("relu", "relu2"):
        if label_sparsity is not None:
            raise ArgumentError("label_sparsity is for SwiGLU/GeGLU models; a ReLU model's neurons fire when non-zero")
        return np.zeros(L, dtype=np.float32)
    cfg = m._model.sparsity
    if label_sparsity is None and cfg["calibrated"] and cfg["criterion"] == "product":
        return np.asarray(cfg["threshold"], dtype=np.float32)
    share = 0.5 if label_sparsity is None else float(label_sparsity)
    if not 0 < share < 1:
        raise ArgumentError(f"label_sparsity must be in (0, 1), got {label_sparsity!r}")
    probe = _core.ActivationRecorder(m._model, np.zeros(L, dtype=np.float32))
    run_chunks(m, chunks[:1], probe)
    r = probe.result()
    return layer_quantiles(r["prod_hist"], r["hist_edges"], share)


def _threshold_for_recall(scores: np.ndarray, labels: np.ndarray, recall: float) -> float:
    """The largest threshold t such that scores > t holds for at least `recall` of the positives."""
    pos = scores[labels]
    if pos.size == 0:
        return float(np.max(scores)) if scores.size else 0.0
    k = int(np.floor((1.0 - recall) * pos.size))
    kth = np.partition(pos, k)[k]
    return float(np.nextafter(np.float32(kth), np.float32(-np.inf)))


def _rank_grid(k_max: int, step: int) -> list[int]:
    grid, r = [], step
    while r < k_max:
        grid.append(r)
        r *= 2
    grid.append(k_max)
    return sorted(set(grid))


def _orthonormal(Y: np.ndarray) -> np.ndarray:
    """An orthonormal basis of Y's columns through the eigenvectors of its Gram matrix (float64): far
    faster than LAPACK's QR here, and as good for a range finder."""
    w, U = np.linalg.eigh((Y.T @ Y).astype(np.float64))
    keep = w > w.max() * 1e-10
    return (Y @ (U[:, keep] / np.sqrt(w[keep])).astype(np.float32)).astype(np.float32)


def _low_rank_gate(G: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """The top-k right singular vectors of G [S, F] as columns [F, k]: a randomized range finder (one power
    iteration), then the eigenvectors of the small Gram matrix of the projected rows."""
    S, F = G.shape
    kk = min(k + _OVERSAMPLE, S, F)
    Q = _orthonormal(G @ rng.standard_normal((F, kk)).astype(np.float32))
    for _ in range(_POWER_ITERS):
        Q = _orthonormal(G @ (G.T @ Q))
    Bm = Q.T @ G  # [kk, F]: G ~ Q Bm
    w, U = np.linalg.eigh((Bm @ Bm.T).astype(np.float64))
    top = np.argsort(w)[::-1][:k]
    s = np.sqrt(np.maximum(w[top], 1e-30))
    V = ((Bm.T @ U[:, top].astype(np.float32)) / s.astype(np.float32)).astype(np.float32)  # [F, k]
    # Fix the sign of each vector (the largest component positive): the same input, the same file.
    sign = np.sign(V[np.argmax(np.abs(V), axis=0), np.arange(V.shape[1])])
    return V * np.where(sign == 0, 1, sign)


def _roundtrip(w: np.ndarray, qtype: str) -> np.ndarray:
    """w as the engine will see it after storage in qtype."""
    if qtype == "f16":
        return w.astype(np.float16).astype(np.float32)
    return quant.dequantize(quant.quantize(w, "Q8_0"), "Q8_0", w.shape[-1])


def _samples(path: str, docs: list[str], n_tokens: int, n_ctx: int, n_threads: int | None,
             thresholds: Callable, progress: bool = False) -> tuple[dict, np.ndarray, dict]:
    """Runs the model (dense, on the CPU) over the first n_tokens tokens of docs with a recorder keeping
    every token's FFN input and firing mask: (hparams, the firing thresholds, the recorder's result).
    thresholds(model, chunks) says above which |act(gate) * up| a neuron fires, per layer."""
    m = Model(path, n_ctx=n_ctx, n_threads=n_threads, sparsity="none", predictors=None, device="cpu")
    try:
        chunks = token_chunks(m, docs, min(n_ctx, m.n_ctx), n_tokens)
        thr = thresholds(m, chunks)
        rec = _core.ActivationRecorder(m._model, thr, 1, sum(len(c) for c in chunks))
        run_chunks(m, chunks, rec, progress, "samples")
        return m.hparams, thr, rec.result()
    finally:
        m.close()


def _check_training(recall, samples, held_out, qtype, max_rank) -> None:
    if isinstance(recall, bool) or not isinstance(recall, (int, float)) or not 0.5 <= recall < 1:
        raise ArgumentError(f"recall must be in [0.5, 1), got {recall!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 64:
        raise ArgumentError(f"samples must be an integer >= 64, got {samples!r}")
    if not 0 < held_out < 0.9:
        raise ArgumentError(f"held_out must be in (0, 0.9), got {held_out!r}")
    if qtype is not None and qtype.lower() not in ("q8_0", "f16"):
        raise ArgumentError(f"qtype must be 'q8_0' or 'f16', not {qtype!r}")
    if max_rank is not None and (isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1):
        raise ArgumentError(f"max_rank must be a positive integer, got {max_rank!r}")


def _storage_type(qtype: str | None, n_embd: int) -> str:
    """The predictors' tensor type: Q8_0 where n_embd allows it (a multiple of 32), else F16."""
    qtype = ("q8_0" if n_embd % 32 == 0 else "f16") if qtype is None else qtype.lower()
    if qtype == "q8_0" and n_embd % 32:
        raise ArgumentError(f"Q8_0 predictors need n_embd to be a multiple of 32 (it is {n_embd}); use qtype='f16'")
    return qtype


def _read_costs(f, path: str, hp: dict, qtype: str) -> tuple[float, float]:
    """Bytes a token reads per unit of rank (a row of A and a column of B in qtype) and per predicted-active
    neuron (its gate and up rows, its neuron-major Q8_0 down row): what the rank search minimizes."""
    E, F = hp["n_embd"], hp["n_ff"]
    if "blk.0.ffn_gate.weight" not in {t.name for t in f.tensors}:
        raise ArgumentError(f"{path}: the model has no gated FFN (blk.N.ffn_gate.weight); predictors need one")
    neuron_bytes = 2 * f.tensor("blk.0.ffn_gate.weight").n_bytes / F + E / 32 * 34
    per_rank = (E + F) * (34 / 32 if qtype == "q8_0" else 2)
    return per_rank, neuron_bytes


def _train_layer(X: np.ndarray, Y: np.ndarray, W: np.ndarray, gb: np.ndarray, tr: np.ndarray, ho: np.ndarray,
                 k: int, step: int, costs: tuple[float, float], recall: float, qtype: str,
                 rng: np.random.Generator) -> tuple:
    """One layer's predictor from the sample inputs X [S, E], firing masks Y [S, F], gate W [F, E] and its
    bias gb, trained on the rows tr and chosen on the rows ho: the cheapest rank of the grid up to k whose
    threshold keeps `recall` on ho. Returns (rank, threshold, the held-out predictions, (A, B, bias))."""
    per_rank, neuron_bytes = costs
    F = W.shape[0]
    G = X[tr] @ W.T
    V = _low_rank_gate(G, k, rng)  # [F, <= k]: fewer columns where G's rank is lower
    del G
    # Stored ranks are whole multiples of `step` (Q8_0 rows of B): a gate of lower rank than k is padded with
    # zero directions up to the next multiple, which change no score.
    k = min(k, -(-V.shape[1] // step) * step)
    if V.shape[1] < k:
        V = np.concatenate([V, np.zeros((F, k - V.shape[1]), np.float32)], axis=1)
    A = (V.T @ W).astype(np.float32)  # [k, E]
    Zho = X[ho] @ A.T  # [n_ho, k]
    Yho = Y[ho]
    best = None
    scores = np.broadcast_to(gb, (len(ho), F)).astype(np.float32)
    prev = 0
    for r_ in _rank_grid(k, step):
        scores += Zho[:, prev:r_] @ V[:, prev:r_].T
        prev = r_
        t = _threshold_for_recall(scores, Yho, recall)
        share = float(np.mean(scores > t))
        cost = r_ * per_rank + share * F * neuron_bytes
        if best is None or cost < best[0]:
            best = (cost, r_)
    rank = best[1]
    # The chosen rank as stored (quantized), its threshold on held-out tokens.
    Aq = _roundtrip(np.ascontiguousarray(A[:rank]), qtype)
    Bq = _roundtrip(np.ascontiguousarray(V[:, :rank]), qtype)
    sc = (X[ho] @ Aq.T) @ Bq.T + gb
    t = _threshold_for_recall(sc, Yho, recall)
    return rank, t, sc > t, (np.ascontiguousarray(A[:rank]), np.ascontiguousarray(V[:, :rank]), gb.astype(np.float32))


def train_predictors(
    model,
    data: Sequence[str | os.PathLike] | str | os.PathLike | None = None,
    recall: float = 0.99,
    out: str | os.PathLike | None = None,
    samples: int = 4096,
    label_sparsity: float | None = None,
    max_rank: int | None = None,
    held_out: float = 0.2,
    qtype: str | None = None,
    seed: int = 0,
    n_ctx: int = 512,
    n_threads: int | None = None,
    progress: bool = True,
    texts: list[str] | None = None,
    field: str = "text",
) -> PredictorTraining:
    """Trains one predictor per layer of `model` (a path) on `samples` tokens of `data` (plain text or JSONL
    files, or `texts`) for a per-layer `recall` target, and writes them to `out` (a companion GGUF) when
    given. Deterministic for a seed. max_rank: the largest rank tried (default min(n_embd, 1024)).
    qtype: "q8_0" (default when n_embd is a multiple of 32) or "f16"."""
    _check_training(recall, samples, held_out, qtype, max_rank)
    path = model_file(model)  # (a known name or a Hugging Face reference, as Model resolves it)
    with gguf.open(path) as f:  # (before the sampling pass, not after it)
        arch = f.metadata.get("general.architecture")
        if f.metadata.get(f"{arch}.expert_count", 0):
            raise ArgumentError(f"{path}: a mixture of experts; activation predictors do not handle experts yet "
                                "(each token's experts run whole)")
        if arch == "phi3":
            raise ArgumentError(f"{path}: phi3 keeps each layer's gate and up in one tensor; optiml train-predictors "
                                "does not train predictors for it yet")
    if out is not None:
        out = check_new_output(out, path)
    docs = texts if texts is not None else read_texts(data, field)
    t0 = time.perf_counter()

    def labels(m, chunks):
        if m.hparams["n_ff"] % 8:
            raise ArgumentError(f"{path}: n_ff = {m.hparams['n_ff']} is not a multiple of 8; predictors need whole "
                                "mask bytes")
        total = sum(len(c) for c in chunks)
        if total < 64:
            raise ArgumentError(f"the data gives {total} tokens; training needs at least 64")
        return _label_thresholds(m, chunks, label_sparsity)

    # 1. Samples: FFN inputs and firing masks of every token of the first `samples` tokens.
    hp, label_thr, r = _samples(path, docs, samples, n_ctx, n_threads, labels, progress)
    sample_x, sample_mask = r.pop("sample_x"), r.pop("sample_mask")  # [S, L, E] f16 bits, [S, L, F/8]
    del r
    timing = {"samples_s": time.perf_counter() - t0}

    # 2. Per layer, on a held-out split of the samples: the cheapest rank that keeps the recall.
    L, E, F = hp["n_layer"], hp["n_embd"], hp["n_ff"]
    S = sample_x.shape[0]
    qtype = _storage_type(qtype, E)
    step = 32 if E >= 32 else E
    k_cap = min(E, 1024 if max_rank is None else max_rank)
    k_cap = max(step, k_cap // step * step)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(S)
    n_ho = max(16, int(round(S * held_out)))
    ho, tr = np.sort(perm[:n_ho]), np.sort(perm[n_ho:])
    k = max(step, min(k_cap, len(tr)) // step * step)
    calib_recall = 1.0 - (1.0 - recall) / 2

    res = PredictorTraining(np.zeros(L, np.int32), np.zeros(L, np.float32), np.zeros(L, np.float32),
                            np.zeros(L, np.float32), np.zeros(L, np.float32), np.asarray(label_thr, np.float32),
                            float(recall), int(S), qtype, out, activation=hp["ffn_act"])
    layers = []
    bar = None
    t1 = time.perf_counter()
    with gguf.open(path) as f:
        costs = _read_costs(f, path, hp, qtype)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=L, unit="layer", desc="train", file=sys.stderr, dynamic_ncols=True)
        names = {t.name for t in f.tensors}
        try:
            for l in range(L):
                X = sample_x[:, l, :].view(np.float16).astype(np.float32)  # [S, E]
                Y = np.unpackbits(sample_mask[:, l, :], axis=1)[:, :F].astype(bool)  # [S, F]
                W = f.dequantize(f"blk.{l}.ffn_gate.weight")  # [F, E]
                gb_name = f"blk.{l}.ffn_gate.bias"
                gb = f.dequantize(gb_name).reshape(-1) if gb_name in names else np.zeros(F, np.float32)
                rank, t, pred, tensors = _train_layer(X, Y, W, gb, tr, ho, k, step, costs, calib_recall, qtype, rng)
                Yho = Y[ho]
                res.rank[l] = rank
                res.threshold[l] = t
                res.recall[l] = float((pred & Yho).sum() / max(1, Yho.sum()))
                res.predicted[l] = float(pred.mean())
                res.active[l] = float(Yho.mean())
                layers.append(tensors)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(rank=rank, predicted=f"{res.predicted[l]:.2f}")
        finally:
            if bar is not None:
                bar.close()
    timing["train_s"] = time.perf_counter() - t1
    res.seconds = timing
    if out is not None:
        write_predictors(out, layers, res, path, model_fingerprint(path), hp)
    return res


def mask_quality(model, predictors: str | os.PathLike, data=None, n_tokens: int = 2048, texts: list[str] | None = None,
                 label_threshold: np.ndarray | None = None, n_ctx: int = 512, field: str = "text") -> dict:
    """Recall and precision per layer of a predictor file's masks against the model's own firing (the
    labels training used, or `label_threshold`) on up to n_tokens tokens of other text."""
    path = os.fspath(model)
    meta = check_predictors(predictors, path)
    docs = texts if texts is not None else read_texts(data, field)
    thr = np.asarray(meta["optiml.predictor.label_threshold"] if label_threshold is None else label_threshold,
                     dtype=np.float32)
    hp, _, r = _samples(path, docs, n_tokens, n_ctx, None, lambda m, chunks: thr)
    L, F = hp["n_layer"], hp["n_ff"]
    pt = np.asarray(meta["optiml.predictor.threshold"], dtype=np.float32)
    recall, precision, predicted, active = (np.zeros(L) for _ in range(4))
    tp_all = y_all = 0
    with gguf.open(predictors) as f:
        for l in range(L):
            X = r["sample_x"][:, l, :].view(np.float16).astype(np.float32)
            Y = np.unpackbits(r["sample_mask"][:, l, :], axis=1)[:, :F].astype(bool)
            A = f.dequantize(f"blk.{l}.ffn_pred_a.weight")
            B = f.dequantize(f"blk.{l}.ffn_pred_b.weight")
            b = f.dequantize(f"blk.{l}.ffn_pred_b.bias").reshape(-1)
            P = (X @ A.T) @ B.T + b > pt[l]
            tp = (P & Y).sum()
            tp_all += int(tp)
            y_all += int(Y.sum())
            recall[l] = tp / max(1, Y.sum())
            precision[l] = tp / max(1, P.sum())
            predicted[l] = P.mean()
            active[l] = Y.mean()
    return {"recall": recall, "precision": precision, "predicted": predicted, "active": active,
            "n_tokens": int(r["n_tokens"]),
            "recall_all": tp_all / max(1, y_all)}
