"""Perplexity, and KL divergence against a saved base model, with llama.cpp's conventions.

    from optiml import Model, perplexity
    with Model("model-f16.gguf", n_ctx=256) as base:
        perplexity.save_base("base.kld", base, text)          # the base's log-probs, token by token
    with Model("model-q4_1.gguf", n_ctx=256) as m:
        r = perplexity.compare("base.kld", m)                  # the same tokens through another model
    print(r.format())                                          # KLD mean, percentiles, same top %, delta ppl

The text is cut into non-overlapping windows of n_ctx tokens (BOS replacing each window's first token
when the model adds BOS); each window runs from an empty context and only its second half is scored
(positions n_ctx/2 .. n_ctx-2, each predicting the next token): n_ctx/2 - 1 tokens per window.

Base file format (".kld", version 1; little-endian; readable with numpy alone, see read_base):
    8 bytes  b"OPTIMLKL"
    uint32   version (1)
    uint32   header length in bytes, then that many bytes of UTF-8 JSON:
             {"n_vocab", "n_ctx", "n_chunks", "first", "top_k", "logp_step", "model"}
    int32    tokens[n_chunks * n_ctx]: the windows exactly as evaluated (BOS already in place)
    zero padding to a multiple of 64 bytes, then one record per scored token, window by window:
      top_k == 0 (the full distribution, as llama.cpp stores it):
        float32 target_logp   the base's log-prob of the token that follows
        float32 max_logp      the largest log-prob
        uint16  q[n_vocab]    log-prob of token i = max_logp - q[i] * logp_step (logp_step = 32/65535:
                              error under 2.5e-4; log-probs below max_logp - 32 are clamped there)
      top_k > 0 (compact: the k most likely tokens and one bucket for the rest):
        float32 target_logp
        float32 tail_logp     log of the probability of every token outside the top k together
        int32   ids[top_k]    the k most likely tokens, most likely first
        float32 logp[top_k]   their log-probs
A full base costs 2 bytes per vocabulary entry per scored token (SmolLM2, 49152 entries: 98 KB a token).
A top-k base gives the KL divergence with the tail lumped into one outcome: a lower bound of the full
value, which is low by about the tail's share (with k = 256 on a 135M model: ~10% of the tail mass,
~12% of the KLD), so keep it for quick comparisons and the full form for numbers to publish.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from .._core import ArgumentError, OptimlError
from ..util.atomic import atomic_output

MAGIC = b"OPTIMLKL"
VERSION = 1
LOGP_RANGE = 32.0  # full records keep log-probs down to max - 32 (probability ratio 1e-14)
LOGP_STEP = LOGP_RANGE / 65535


# ---- windows and log-probs ------------------------------------------------------------------------
def windows(model, text: str, n_ctx: int, n_chunks: int = -1) -> list[list[int]]:
    """The text's tokens cut into llama.cpp's perplexity windows (BOS in place of each first token
    when the model adds BOS)."""
    if n_ctx < 4:
        raise ArgumentError(f"n_ctx={n_ctx} is too small for perplexity (use at least 4)")
    if n_chunks == 0 or n_chunks < -1:
        raise ArgumentError(f"the number of windows (--chunks) must be at least 1, or -1 for all; got {n_chunks}")
    tokens = model.tokenize(text, add_bos=True)
    n_max = len(tokens) // n_ctx
    n = n_max if n_chunks < 0 else min(n_chunks, n_max)
    if n == 0:
        raise ArgumentError(f"the text has {len(tokens)} tokens, fewer than one window of {n_ctx} (use a smaller --ctx)")
    out = []
    for i in range(n):
        w = tokens[i * n_ctx : (i + 1) * n_ctx]
        if model.tokenizer.add_bos:
            w[0] = model.tokenizer.bos_id
        out.append(w)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def scored_logp(model, window: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(log-probs [n_ctx/2 - 1, n_vocab] float64, targets) of one window's scored half."""
    first = len(window) // 2
    model.reset()
    logits = model.eval(window, all_logits=True)
    return log_softmax(logits[first : len(window) - 1]), np.asarray(window[first + 1 :], dtype=np.int64)


def _ppl(nll: np.ndarray) -> tuple[float, float]:
    """Perplexity of per-token negative log-likelihoods and its standard error (llama.cpp's)."""
    n = len(nll)
    mean = float(nll.mean())
    ppl = math.exp(mean)
    var = float((nll * nll).mean()) - mean * mean
    return ppl, (math.sqrt(var / (n - 1)) * ppl if var > 0 and n > 1 else 0.0)


def perplexity(model, text: str, n_ctx: int, n_chunks: int = -1, progress=None) -> tuple[float, float, int]:
    """Perplexity with llama.cpp's convention (see the module docstring). Returns (ppl, its standard
    error, tokens scored). `progress(i, n, ppl)` is called after each window."""
    ws = windows(model, text, n_ctx, n_chunks)
    try:
        return _score_windows(model, ws, progress, lambda logp, targets: -logp[np.arange(len(targets)), targets])
    finally:
        model.reset()


def _score_windows(model, ws, progress, window_nll) -> tuple[float, float, int]:
    """Scores the windows in turn, window_nll(logp, targets) giving a window's per-token negative
    log-likelihoods, `progress(i, n, ppl)` after each. Returns (ppl, its standard error, tokens scored)."""
    nll = []
    for i, w in enumerate(ws):
        nll.append(window_nll(*scored_logp(model, w)))
        if progress:
            progress(i + 1, len(ws), math.exp(np.concatenate(nll).mean()))
    nll = np.concatenate(nll)
    return (*_ppl(nll), len(nll))


# ---- per-token comparison of two distributions --------------------------------------------------
def token_stats(base_logp: np.ndarray, logp: np.ndarray, targets=None) -> dict:
    """Per-token statistics of a model's log-probs against a base's, both full [n, n_vocab]:
    kld = sum_i p_base(i) * (log p_base(i) - log p(i)), same_top (argmaxes equal), and when the
    targets are given, nll/nll_base (-log-prob of the target) and p/p_base (its probability)."""
    base_logp = np.asarray(base_logp, dtype=np.float64)
    logp = np.asarray(logp, dtype=np.float64)
    if base_logp.shape != logp.shape:
        raise ArgumentError(f"log-prob shapes differ: base {base_logp.shape}, model {logp.shape}")
    out = {"kld": (np.exp(base_logp) * (base_logp - logp)).sum(axis=1),
           "same_top": base_logp.argmax(axis=1) == logp.argmax(axis=1)}
    if targets is not None:
        rows = np.arange(len(base_logp))
        out["nll_base"] = -base_logp[rows, targets]
        out["nll"] = -logp[rows, targets]
    return out


def _top_k_stats(rec, logp: np.ndarray, targets: np.ndarray) -> dict:
    """token_stats against a top-k base: the k named tokens, plus the rest as one outcome."""
    ids = rec["ids"].astype(np.int64)
    bp = rec["logp"].astype(np.float64)
    q = np.take_along_axis(logp, ids, axis=1)
    q_tail = np.log(np.maximum(-np.expm1(_logsumexp(q)), 1e-300))  # log(1 - sum of the top-k's p)
    b_tail = rec["tail_logp"].astype(np.float64)
    kld = (np.exp(bp) * (bp - q)).sum(axis=1) + np.exp(b_tail) * (b_tail - q_tail)
    rows = np.arange(len(logp))
    return {"kld": kld, "same_top": ids[:, 0] == logp.argmax(axis=1),
            "nll_base": -rec["target_logp"].astype(np.float64), "nll": -logp[rows, targets]}


def _logsumexp(x: np.ndarray) -> np.ndarray:
    mx = x.max(axis=1)
    return mx + np.log(np.exp(x - mx[:, None]).sum(axis=1))


# ---- the base file --------------------------------------------------------------------------------
def record_dtype(n_vocab: int, top_k: int) -> np.dtype:
    if top_k == 0:
        return np.dtype([("target_logp", "<f4"), ("max_logp", "<f4"), ("q", "<u2", (n_vocab,))])
    return np.dtype([("target_logp", "<f4"), ("tail_logp", "<f4"), ("ids", "<i4", (top_k,)), ("logp", "<f4", (top_k,))])


def encode_records(logp: np.ndarray, targets: np.ndarray, top_k: int) -> np.ndarray:
    """One window's scored log-probs (float64 [n, n_vocab]) as base-file records."""
    n, n_vocab = logp.shape
    rec = np.zeros(n, record_dtype(n_vocab, top_k))
    rec["target_logp"] = logp[np.arange(n), targets]
    if top_k == 0:
        mx = logp.max(axis=1)
        rec["max_logp"] = mx
        rec["q"] = np.clip(np.rint((mx[:, None] - logp) / LOGP_STEP), 0, 65535)
        return rec
    ids = np.argpartition(-logp, top_k - 1, axis=1)[:, :top_k]
    order = np.argsort(-np.take_along_axis(logp, ids, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=1)
    top = np.take_along_axis(logp, ids, axis=1)
    rec["ids"] = ids
    rec["logp"] = top
    rec["tail_logp"] = np.log(np.maximum(-np.expm1(_logsumexp(top)), 1e-300))
    return rec


def decode_full(rec) -> np.ndarray:
    """Full records back to log-probs (float64 [n, n_vocab]), renormalized."""
    lp = rec["max_logp"].astype(np.float64)[:, None] - rec["q"].astype(np.float64) * LOGP_STEP
    return log_softmax(lp)


@dataclass
class Base:
    """A base file, read back: header fields, the windows' tokens and the records (memory-mapped)."""

    path: str
    n_vocab: int
    n_ctx: int
    n_chunks: int
    first: int
    top_k: int
    model: str
    tokens: np.ndarray  # int32 [n_chunks, n_ctx]
    records: np.ndarray  # [n_chunks, n_ctx - 1 - first] of record_dtype

    def window(self, i: int) -> list[int]:
        return [int(t) for t in self.tokens[i]]


def save_base(path, model, text: str, n_ctx: int, n_chunks: int = -1, top_k: int = 0,
              progress=None) -> tuple[float, float, int]:
    """Runs `model` over the text's perplexity windows and writes its log-probs of every scored token
    to `path` (format in the module docstring; top_k=0 keeps the full distribution). Returns the
    base's (ppl, its standard error, tokens scored)."""
    if top_k < 0:
        raise ArgumentError(f"top_k={top_k}: use 0 (full distribution) or a positive count")
    ws = windows(model, text, n_ctx, n_chunks)
    n_vocab = model.n_vocab
    if top_k >= n_vocab:
        top_k = 0
    first = n_ctx // 2
    header = json.dumps({"n_vocab": n_vocab, "n_ctx": n_ctx, "n_chunks": len(ws), "first": first, "top_k": top_k,
                         "logp_step": LOGP_STEP, "model": os.path.basename(str(model.path))}).encode()
    try:
        with atomic_output(path) as tmp, open(tmp, "wb") as f:
            f.write(MAGIC + np.array([VERSION, len(header)], "<u4").tobytes() + header)
            f.write(np.asarray(ws, dtype="<i4").tobytes())
            f.write(b"\0" * (-f.tell() % 64))

            def write_records(logp, targets):
                rec = encode_records(logp, targets, top_k)
                f.write(rec.tobytes())
                return -rec["target_logp"].astype(np.float64)

            result = _score_windows(model, ws, progress, write_records)
    finally:
        model.reset()
    return result


def read_base(path) -> Base:
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise OptimlError(f"{path} is not an optiml KL-divergence base (write one with "
                              "optiml perplexity --kl-divergence-base FILE, without --kl-divergence)")
        version, n_header = np.frombuffer(head[8:], "<u4")
        if version != VERSION:
            raise OptimlError(f"{path}: base format version {version}, this optiml reads version {VERSION}")
        h = json.loads(f.read(int(n_header)))
    offset = 16 + int(n_header)
    n_ctx, n_chunks = h["n_ctx"], h["n_chunks"]
    tokens = np.fromfile(path, "<i4", count=n_ctx * n_chunks, offset=offset).reshape(n_chunks, n_ctx)
    offset += 4 * n_ctx * n_chunks
    offset += -offset % 64
    dt = record_dtype(h["n_vocab"], h["top_k"])
    per_chunk = n_ctx - 1 - h["first"]
    size = os.path.getsize(path)
    if size != offset + dt.itemsize * per_chunk * n_chunks:
        raise OptimlError(f"{path} has {size} bytes, its header promises {offset + dt.itemsize * per_chunk * n_chunks} "
                          "(a truncated or damaged file: write it again)")
    records = np.memmap(path, dt, mode="r", offset=offset, shape=(n_chunks, per_chunk))
    return Base(path, h["n_vocab"], n_ctx, n_chunks, h["first"], h["top_k"], h.get("model", ""), tokens, records)


# ---- comparison -----------------------------------------------------------------------------------
PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0)


@dataclass
class KLDResult:
    """Per-token results of a model against a base, and their summary in llama.cpp's terms."""

    kld: np.ndarray  # per scored token
    same_top: np.ndarray  # bool per scored token
    nll: np.ndarray  # the model's -log p(target)
    nll_base: np.ndarray  # the base's
    top_k: int = 0  # the base's top_k (0: full distribution, exact KLD)

    @property
    def n(self) -> int:
        return len(self.kld)

    def summary(self) -> dict:
        n = self.n
        ppl, ppl_err = _ppl(self.nll)
        ppl_base, ppl_base_err = _ppl(self.nll_base)
        d = self.nll - self.nll_base  # per-token ln(PPL(Q)/PPL(base))
        d_err = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
        # PPL(Q) - PPL(base) = e^mean(nll) - e^mean(nll_base); its error by the delta method.
        cov = np.cov(self.nll, self.nll_base) if n > 1 else np.zeros((2, 2))
        diff_var = ppl * ppl * cov[0, 0] + ppl_base * ppl_base * cov[1, 1] - 2 * ppl * ppl_base * cov[0, 1]
        p = float(self.same_top.mean())
        dp = np.exp(-self.nll) - np.exp(-self.nll_base)  # change in the target token's probability
        s = {
            "n_tokens": n, "ppl": ppl, "ppl_err": ppl_err, "ppl_base": ppl_base, "ppl_base_err": ppl_base_err,
            "cor_ln_ppl": float(np.corrcoef(self.nll, self.nll_base)[0, 1]) if n > 1 else 1.0,
            "ln_ppl_ratio": float(d.mean()), "ln_ppl_ratio_err": d_err,
            "ppl_ratio": math.exp(d.mean()), "ppl_ratio_err": math.exp(d.mean()) * d_err,
            "delta_ppl": ppl - ppl_base, "delta_ppl_err": math.sqrt(max(diff_var, 0.0) / n),
            "kld_mean": float(self.kld.mean()),
            "kld_err": float(self.kld.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
            "kld_max": float(self.kld.max()), "kld_min": float(self.kld.min()),
            "same_top": p, "same_top_err": math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0,
            "delta_p_mean": float(dp.mean()), "delta_p_rms": float(np.sqrt((dp * dp).mean())),
            "top_k": self.top_k,
        }
        for q in PERCENTILES:
            s[f"kld_p{q:g}"] = float(np.percentile(self.kld, q))
        return s

    def format(self) -> str:
        s = self.summary()
        lines = [
            f"====== Perplexity statistics ({s['n_tokens']} tokens) ======",
            f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_err']:10.6f}",
            f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_err']:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor_ln_ppl']:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_err']:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_err']:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {s['delta_ppl']:10.6f} ± {s['delta_ppl_err']:10.6f}",
            "",
            "====== KL divergence statistics ======" + (f" (top-{s['top_k']} base: a lower bound)" if s["top_k"] else ""),
            f"Mean    KLD: {s['kld_mean']:10.6f} ± {s['kld_err']:10.6f}",
            f"Maximum KLD: {s['kld_max']:10.6f}",
        ]
        for q in PERCENTILES:
            label = "Median " if q == 50.0 else f"{q:4.1f}%  "
            lines.append(f"{label} KLD: {s[f'kld_p{q:g}']:10.6f}")
        lines += [
            f"Minimum KLD: {s['kld_min']:10.6f}",
            "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100 * s['delta_p_mean']:8.3f} %",
            f"RMS     Δp: {100 * s['delta_p_rms']:8.3f} %",
            f"Same top p: {100 * s['same_top']:8.3f} ± {100 * s['same_top_err']:6.3f} %",
        ]
        return "\n".join(lines)


def compare(base, model, n_chunks: int = -1, progress=None) -> KLDResult:
    """Runs `model` over a base file's windows (its stored tokens) and compares, token by token.
    `base` is a path or a Base; `progress(i, n, kld_mean)` is called after each window."""
    if not isinstance(base, Base):
        base = read_base(base)
    if model.n_vocab != base.n_vocab:
        raise OptimlError(f"the model has {model.n_vocab} vocabulary entries, the base ({base.model}) has "
                          f"{base.n_vocab}: KL divergence needs the same tokenizer")
    n = base.n_chunks if n_chunks < 0 else min(n_chunks, base.n_chunks)
    parts = []
    try:
        for i in range(n):
            logp, targets = scored_logp(model, base.window(i))
            rec = np.asarray(base.records[i])
            if base.top_k == 0:
                st = token_stats(decode_full(rec), logp, targets)
                st["nll_base"] = -rec["target_logp"].astype(np.float64)
            else:
                st = _top_k_stats(rec, logp, targets)
            parts.append(st)
            if progress:
                progress(i + 1, n, float(np.concatenate([p["kld"] for p in parts]).mean()))
    finally:
        model.reset()
    cat = {k: np.concatenate([p[k] for p in parts]) for k in ("kld", "same_top", "nll", "nll_base")}
    return KLDResult(cat["kld"], cat["same_top"], cat["nll"], cat["nll_base"], base.top_k)
