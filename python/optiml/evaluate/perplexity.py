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
llama.cpp's base files (llama-perplexity --kl-divergence-base, magic b"_logits_") are another format,
which read_base refuses.
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

from .._core import ArgumentError
from ..engine.batch import Batch
from ..util.atomic import atomic_output

MAGIC = b"OPTIMLKL"
LLAMA_CPP_MAGIC = b"_logits_"  # llama-perplexity's base files, which this module does not read
VERSION = 1
LOGP_RANGE = 32.0  # full records keep log-probs down to max - 32 (probability ratio 1e-14)
LOGP_STEP = LOGP_RANGE / 65535
# The log-softmax and the statistics run over blocks of this many float64 values (32 MiB: 16 rows of Gemma 3's
# 262144 entries, 85 of SmolLM2's 49152), so that the float32 logits of a window's scored half, as llama.cpp
# keeps them, stay the largest thing in memory at any n_ctx: a whole half in float64, with its temporaries,
# took 6.7 GB for Gemma 3 at n_ctx 2048. Each row's result is the same whatever the block.
BLOCK_VALUES = 1 << 22


# ---- windows and log-probs ------------------------------------------------------------------------
def check_chunks(n_chunks: int) -> None:
    """The number of windows to score: at least 1, or -1 for all of them (llama.cpp's --chunks)."""
    if n_chunks == 0 or n_chunks < -1:
        raise ArgumentError(f"the number of windows (--chunks) must be at least 1, or -1 for all; got {n_chunks}")


def windows(model, text: str, n_ctx: int, n_chunks: int = -1, advice: str = "use a smaller --ctx") -> list[list[int]]:
    """The text's tokens cut into llama.cpp's perplexity windows (BOS in place of each first token
    when the model adds BOS). `advice`: what the error for a text shorter than one window suggests."""
    if n_ctx < 4:
        raise ArgumentError(f"n_ctx={n_ctx} is too small for perplexity (use at least 4)")
    check_chunks(n_chunks)
    tokens = model.tokenize(text, add_bos=True)
    n_max = len(tokens) // n_ctx
    n = n_max if n_chunks < 0 else min(n_chunks, n_max)
    if n == 0:
        raise ArgumentError(f"the text has {len(tokens)} tokens, fewer than one window of {n_ctx} ({advice})")
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


def scored_logits(model, window: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logits [n_ctx/2 - 1, n_vocab] float32, targets) of one window's scored half: the window runs from
    an empty context in one decode (the same batches as eval), asking for the scored rows' logits only."""
    first = len(window) // 2
    model.reset()
    batch = Batch()
    for i, t in enumerate(window):
        batch.add(t, 0, i, first <= i < len(window) - 1)
    return model.decode(batch), np.asarray(window[first + 1 :], dtype=np.int64)


def scored_logp(model, window: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(log-probs [n_ctx/2 - 1, n_vocab] float64, targets) of one window's scored half (all of it at once:
    the scoring below goes block by block, see BLOCK_VALUES)."""
    logits, targets = scored_logits(model, window)
    return log_softmax(logits), targets


def _scored_blocks(model, window: list[int]):
    """One window's scored half in row blocks of about BLOCK_VALUES values: yields (rows: a slice of the
    half, float64 log-probs of those rows, their targets)."""
    logits, targets = scored_logits(model, window)
    step = max(1, BLOCK_VALUES // logits.shape[1])
    for a in range(0, len(targets), step):
        rows = slice(a, a + step)
        yield rows, log_softmax(logits[rows]), targets[rows]


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


def _score_windows(model, ws, progress, block_nll) -> tuple[float, float, int]:
    """Scores the windows in turn, block_nll(logp, targets) giving the per-token negative log-likelihoods of a
    block of a window's scored rows (in order), `progress(i, n, ppl)` after each window. Returns (ppl, its
    standard error, tokens scored)."""
    nll = []
    for i, w in enumerate(ws):
        nll += [block_nll(logp, targets) for _, logp, targets in _scored_blocks(model, w)]
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

            def write_records(logp, targets):  # (a block of a window's rows at a time, in order)
                rec = encode_records(logp, targets, top_k)
                f.write(rec.tobytes())
                return -rec["target_logp"].astype(np.float64)

            result = _score_windows(model, ws, progress, write_records)
    finally:
        model.reset()
    return result


def read_base(path) -> Base:
    """A base file written by save_base. Anything else, a damaged or truncated base included, is refused with
    ArgumentError (bad input) naming the file."""
    path = os.fspath(path)
    again = "write it again with optiml perplexity -m BASE_MODEL -f TEXT --kl-divergence-base FILE"
    with open(path, "rb") as f:
        head = f.read(16)
        if head[:8] == LLAMA_CPP_MAGIC:
            raise ArgumentError(f"{path} is a llama.cpp base (llama-perplexity --kl-divergence-base, magic "
                                '"_logits_"), a format optiml does not read: write an optiml base from the same '
                                "text with optiml perplexity -m BASE_MODEL -f TEXT --kl-divergence-base FILE")
        if len(head) < 16 or head[:8] != MAGIC:
            raise ArgumentError(f"{path} is not an optiml KL-divergence base (write one with "
                                "optiml perplexity --kl-divergence-base FILE, without --kl-divergence)")
        version, n_header = (int(v) for v in np.frombuffer(head[8:], "<u4"))
        if version != VERSION:
            raise ArgumentError(f"{path}: base format version {version}, this optiml reads version {VERSION}: "
                                f"{again}")
        raw = f.read(n_header)
    if len(raw) < n_header:
        raise ArgumentError(f"{path} ends inside its header (a truncated or damaged file): {again}")
    h = _header(path, raw, again)
    n_vocab, n_ctx, n_chunks, first, top_k = (h[k] for k in ("n_vocab", "n_ctx", "n_chunks", "first", "top_k"))
    offset = 16 + n_header
    tokens_at = offset
    offset += 4 * n_ctx * n_chunks
    offset += -offset % 64
    dt = record_dtype(n_vocab, top_k)
    per_chunk = n_ctx - 1 - first
    size = os.path.getsize(path)
    want = offset + dt.itemsize * per_chunk * n_chunks
    if size != want:
        raise ArgumentError(f"{path} has {size} bytes, its header promises {want} (a truncated or damaged file): "
                            f"{again}")
    tokens = np.fromfile(path, "<i4", count=n_ctx * n_chunks, offset=tokens_at).reshape(n_chunks, n_ctx)
    if tokens.min() < 0 or tokens.max() >= n_vocab:
        raise ArgumentError(f"{path} holds token ids outside its vocabulary of {n_vocab} (a damaged file): {again}")
    records = np.memmap(path, dt, mode="r", offset=offset, shape=(n_chunks, per_chunk))
    return Base(path, n_vocab, n_ctx, n_chunks, first, top_k, str(h.get("model", "")), tokens, records)


def _header(path: str, raw: bytes, again: str) -> dict:
    """A base file's JSON header, checked: every field read_base needs, of the type and range save_base
    writes."""
    try:
        h = json.loads(raw)
    except ValueError as e:  # (JSONDecodeError and UnicodeDecodeError both are)
        raise ArgumentError(f"{path}: its header is not valid JSON ({e}): a damaged file; {again}") from None
    if not isinstance(h, dict):
        raise ArgumentError(f"{path}: its header is not a JSON object: a damaged file; {again}")
    missing = [k for k in ("n_vocab", "n_ctx", "n_chunks", "first", "top_k") if k not in h]
    if missing:
        raise ArgumentError(f"{path}: its header lacks {', '.join(missing)}: a damaged file; {again}")
    bad = [k for k in ("n_vocab", "n_ctx", "n_chunks", "first", "top_k")
           if isinstance(h[k], bool) or not isinstance(h[k], int)]
    if not bad:
        bad = [k for k, ok in (("n_vocab", h["n_vocab"] >= 1), ("n_ctx", h["n_ctx"] >= 4),
                               ("n_chunks", h["n_chunks"] >= 1), ("first", h["first"] == h["n_ctx"] // 2),
                               ("top_k", 0 <= h["top_k"] < h["n_vocab"]),
                               ("logp_step", h.get("logp_step", LOGP_STEP) == LOGP_STEP)) if not ok]
    if bad:
        raise ArgumentError(f"{path}: its header has bad values ({', '.join(f'{k}={h.get(k)!r}' for k in bad)}): "
                            f"a damaged file; {again}")
    return h


# ---- comparison -----------------------------------------------------------------------------------
# The percentiles llama.cpp's report prints (50: the median), of the per-token KLD and of Δp.
PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DELTA_P_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def _mean_err(x: np.ndarray) -> float:
    """The standard error of x's mean (llama.cpp's mean_and_uncertainty: sqrt(var / (n - 1)))."""
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


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
        d_err = _mean_err(d)
        # PPL(Q) - PPL(base) = e^mean(nll) - e^mean(nll_base); its error by the delta method.
        cov = np.cov(self.nll, self.nll_base) if n > 1 else np.zeros((2, 2))
        diff_var = ppl * ppl * cov[0, 0] + ppl_base * ppl_base * cov[1, 1] - 2 * ppl * ppl_base * cov[0, 1]
        p = float(self.same_top.mean())
        dp = np.exp(-self.nll) - np.exp(-self.nll_base)  # change in the target token's probability
        # RMS Δp and its error as llama.cpp has them: the mean of dp² with its standard error, carried
        # through the square root (d sqrt(x) = dx / (2 sqrt(x))).
        dp2 = dp * dp
        rms = math.sqrt(float(dp2.mean()))
        s = {
            "n_tokens": n, "ppl": ppl, "ppl_err": ppl_err, "ppl_base": ppl_base, "ppl_base_err": ppl_base_err,
            "cor_ln_ppl": float(np.corrcoef(self.nll, self.nll_base)[0, 1]) if n > 1 else 1.0,
            "ln_ppl_ratio": float(d.mean()), "ln_ppl_ratio_err": d_err,
            "ppl_ratio": math.exp(d.mean()), "ppl_ratio_err": math.exp(d.mean()) * d_err,
            "delta_ppl": ppl - ppl_base, "delta_ppl_err": math.sqrt(max(diff_var, 0.0) / n),
            "kld_mean": float(self.kld.mean()), "kld_err": _mean_err(self.kld),
            "kld_max": float(self.kld.max()), "kld_min": float(self.kld.min()),
            "same_top": p, "same_top_err": math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0,
            "delta_p_mean": float(dp.mean()), "delta_p_mean_err": _mean_err(dp),
            "delta_p_rms": rms, "delta_p_rms_err": 0.5 / rms * _mean_err(dp2) if rms > 0 else 0.0,
            "delta_p_max": float(dp.max()), "delta_p_min": float(dp.min()),
            "top_k": self.top_k,
        }
        # np.percentile's default (linear between the two nearest ranks) is llama.cpp's percentile().
        for q in PERCENTILES:
            s[f"kld_p{q:g}"] = float(np.percentile(self.kld, q))
        for q in DELTA_P_PERCENTILES:
            s[f"delta_p_p{q:g}"] = float(np.percentile(dp, q))
        return s

    def format(self) -> str:
        """The report in llama.cpp's layout (the percentile lines of the KLD and of Δp as it prints them)."""
        s = self.summary()

        def label(q, what):  # "Median  KLD", "99.9%   KLD", " 5.0%   Δp"
            return f"Median  {what}" if q == 50.0 else f"{q:4.1f}%   {what}"

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
        lines += [f"{label(q, 'KLD')}: {s[f'kld_p{q:g}']:10.6f}" for q in PERCENTILES]
        lines += [
            f"Minimum KLD: {s['kld_min']:10.6f}",
            "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100 * s['delta_p_mean']:6.3f} ± {100 * s['delta_p_mean_err']:5.3f} %",
            f"Maximum Δp: {100 * s['delta_p_max']:6.3f}%",
        ]
        lines += [f"{label(q, 'Δp')}: {100 * s[f'delta_p_p{q:g}']:6.3f}%" for q in DELTA_P_PERCENTILES]
        lines += [
            f"Minimum Δp: {100 * s['delta_p_min']:6.3f}%",
            f"RMS Δp    : {100 * s['delta_p_rms']:6.3f} ± {100 * s['delta_p_rms_err']:5.3f} %",
            f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_err']:5.3f} %",
        ]
        return "\n".join(lines)


def check_model(base: Base, model) -> None:
    """Refuses, before anything runs, a model that cannot be compared with the base: another vocabulary, or
    a context shorter than the base's windows."""
    if model.n_vocab != base.n_vocab:
        raise ArgumentError(f"the model has {model.n_vocab} vocabulary entries, the base {base.path} "
                            f"({base.model}) has {base.n_vocab}: KL divergence needs the same tokenizer; compare "
                            "with a base written by a model of this one's vocabulary")
    if model.n_ctx < base.n_ctx:
        raise ArgumentError(f"the model's context holds {model.n_ctx} tokens, the base's windows {base.n_ctx}: "
                            f"make the model with n_ctx={base.n_ctx}")


def compare(base, model, n_chunks: int = -1, progress=None) -> KLDResult:
    """Runs `model` over a base file's windows (its stored tokens) and compares, token by token.
    `base` is a path or a Base; n_chunks: the first windows only (-1: all); `progress(i, n, kld_mean)`
    is called after each window."""
    if not isinstance(base, Base):
        base = read_base(base)
    check_chunks(n_chunks)
    check_model(base, model)
    n = base.n_chunks if n_chunks == -1 else min(n_chunks, base.n_chunks)
    parts = []
    try:
        for i in range(n):
            # A block of rows at a time: the model's log-probs and, for a full base, the base's decoded ones.
            for rows, logp, targets in _scored_blocks(model, base.window(i)):
                rec = np.asarray(base.records[i, rows])
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
