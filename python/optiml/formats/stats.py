"""Activation statistics: what `optiml profile` measures and `optiml solve` / `optiml calibrate` read.

A stats file is an .npz with these arrays (L layers, F FFN neurons per layer, B histogram bins):

    fingerprint   str        the model it came from (model_fingerprint); other models are refused
    model         str        the model file's name, for messages
    activation    str        "silu", "relu" or "gelu": the FFN's activation function
    n_tokens      int        tokens profiled
    sources       str        the data files, newline-separated
    threshold     f32 [L]    a neuron "fires" on a token when |act(gate) * up| > threshold[l]
    freq          f32 [L, F] share of tokens on which the neuron fired
    mean_abs      f32 [L, F] mean |act(gate) * up|
    mean_abs_up   f32 [L, F] mean |up|
    down_norm     f32 [L, F] L2 norm of the neuron's down column (its weight in the layer output)
    impact        f32 [L, F] mean_abs * down_norm: the neuron's mean contribution to the layer output
    hist_edges    f32 [B+1]  log-spaced bin edges of the two histograms below (first 0, last inf)
    gate_hist     f64 [L, B] tokens x neurons by |act(gate)| (the criterion that also skips up rows), or
                             by |act(gate)| * gate_weight when profiled with per-neuron weights
    gate_err      f64 [L, B] sum of (act(gate) * up)^2 * down_norm^2 in each |act(gate)| bin: the squared
                             output error from dropping those activations
    prod_hist     f64 [L, B] the same by |act(gate) * up|
    prod_err      f64 [L, B]
  optional (profile --samples):
    sample_x      f16 [L, S, n_embd]  FFN inputs (after the FFN norm) of S sampled tokens
    sample_mask   u8  [L, S, F/8]     their firing masks, np.packbits over neurons
  mixtures of experts (X experts of Fe neurons; the per-neuron arrays above are zero for their layers):
    expert_count  i64 [L, X]     tokens the router sent to each expert
    expert_weight f64 [L, X]     the sum of their routing weights
    expert_next   i64 [L, X, X]  [l, a, b]: a token chose b after the token before it (same text) chose a
    expert_freq   f32 [L, X, Fe] share of the tokens routed to the expert on which the neuron fired

Neuron indices are the model file's order. hot_first_order gives the order `optiml solve` places in.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np

from .._core import ArgumentError
from ..util.atomic import atomic_output
from . import gguf

__all__ = ["ActivationStats", "model_fingerprint", "hot_first_order", "load", "save"]

_REQUIRED = ("fingerprint", "model", "activation", "n_tokens", "sources", "threshold", "freq", "mean_abs",
             "mean_abs_up", "down_norm", "impact", "hist_edges", "gate_hist", "gate_err", "prod_hist", "prod_err")
_OPTIONAL = ("sample_x", "sample_mask", "expert_count", "expert_weight", "expert_next", "expert_freq")


def model_fingerprint(path: str | os.PathLike) -> str:
    """A hash of a model's tensor layout and of the bytes at both ends of every FFN tensor: equal for
    the same file (and copies), different once neurons are permuted or weights change."""
    h = hashlib.sha256()
    with gguf.open(path) as f:
        h.update(str(f.metadata.get("general.architecture", "")).encode())
        for t in f.tensors:
            h.update(f"{t.name}:{t.type_name}:{list(t.shape)};".encode())
            if ".ffn_" in t.name:
                data = np.asarray(f.tensor_data(t.name)).view(np.uint8).reshape(-1)
                h.update(data[:4096].tobytes())
                h.update(data[-4096:].tobytes())
    return h.hexdigest()[:32]


@dataclass
class ActivationStats:
    fingerprint: str
    model: str
    activation: str
    n_tokens: int
    sources: str
    threshold: np.ndarray
    freq: np.ndarray
    mean_abs: np.ndarray
    mean_abs_up: np.ndarray
    down_norm: np.ndarray
    impact: np.ndarray
    hist_edges: np.ndarray
    gate_hist: np.ndarray
    gate_err: np.ndarray
    prod_hist: np.ndarray
    prod_err: np.ndarray
    sample_x: np.ndarray | None = None
    sample_mask: np.ndarray | None = None
    expert_count: np.ndarray | None = None
    expert_weight: np.ndarray | None = None
    expert_next: np.ndarray | None = None
    expert_freq: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    @property
    def n_layer(self) -> int:
        return self.freq.shape[0]

    @property
    def n_ff(self) -> int:
        return self.freq.shape[1]

    @property
    def is_moe(self) -> bool:
        return self.expert_count is not None

    def expert_coverage(self, share: float) -> float:
        """Mixtures of experts: the share of all routings that the top `share` of each layer's experts (by
        use) account for."""
        c = np.sort(self.expert_count, axis=1)[:, ::-1]
        k = max(1, int(round(share * c.shape[1])))
        return float(c[:, :k].sum() / max(1, c.sum()))

    @property
    def n_expert_used(self) -> int:
        """Mixtures of experts: the experts each token is routed to."""
        return int(round(self.expert_count.sum(axis=1).max() / max(1, self.n_tokens)))

    def expert_reuse(self) -> float:
        """Mixtures of experts: of a token's experts, the mean share that the token before it chose too
        (k / n_expert when the choices are independent and every expert equally used)."""
        pairs = self.expert_next.sum()
        same = np.trace(self.expert_next, axis1=1, axis2=2).sum()
        return float(same / pairs * self.n_expert_used) if pairs else 0.0

    def expert_firing_rate(self) -> float:
        """Mixtures of experts: the share of an expert's neurons that fire on a token routed to it, over
        all routings (each expert's rate weighted by the tokens it saw)."""
        used = self.expert_count[:, :, None]
        return float((self.expert_freq * used).sum() / max(1, used.sum() * self.expert_freq.shape[2]))

    def check_model(self, path: str | os.PathLike) -> None:
        """ArgumentError unless these stats were measured on the model at path."""
        fp = model_fingerprint(path)
        if fp != self.fingerprint:
            raise ArgumentError(
                f"these activation statistics were measured on {self.model} (fingerprint {self.fingerprint}), "
                f"not on {os.path.basename(os.fspath(path))} (fingerprint {fp}); run `optiml profile` on this model")


def hot_first_order(freq: np.ndarray, impact: np.ndarray) -> np.ndarray:
    """Per layer, neuron indices by firing frequency, most frequent first; ties by impact, then index.
    freq, impact: [L, F]. Returns int64 [L, F]."""
    order = np.empty(freq.shape, dtype=np.int64)
    for l in range(freq.shape[0]):
        order[l] = np.lexsort((np.arange(freq.shape[1]), -impact[l], -freq[l]))
    return order


def save(stats: ActivationStats, path: str | os.PathLike) -> None:
    """Writes the .npz (via a temporary file, renamed when complete)."""
    path = os.fspath(path)
    arrays = {k: getattr(stats, k) for k in _REQUIRED}
    for k in ("fingerprint", "model", "activation", "sources"):
        arrays[k] = np.array(arrays[k])
    arrays["n_tokens"] = np.array(arrays["n_tokens"], dtype=np.int64)
    for k in _OPTIONAL:
        if getattr(stats, k) is not None:
            arrays[k] = getattr(stats, k)
    with atomic_output(path, suffix=".npz") as tmp:  # numpy would append .npz to another name
        np.savez_compressed(tmp, **arrays)


def load(path: str | os.PathLike) -> ActivationStats:
    """Reads a stats file; ArgumentError naming what is wrong when it is not one."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"stats file not found: {path}")
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # (numpy's own message about pickles is no help here)
        why = f": {e}" if isinstance(e, OSError) else ""
        raise ArgumentError(f"{path} is not an activation stats file (.npz from `optiml profile`){why}") from None
    with z:
        missing = [k for k in _REQUIRED if k not in z.files]
        if missing:
            raise ArgumentError(f"{path} is not an activation stats file from `optiml profile`: "
                                f"missing {', '.join(missing)}")
        d = {k: z[k] for k in z.files}
    for k in ("fingerprint", "model", "activation", "sources"):
        d[k] = str(d[k])
    d["n_tokens"] = int(d["n_tokens"])
    s = ActivationStats(**{k: d.pop(k) for k in _REQUIRED}, **{k: d.pop(k, None) for k in _OPTIONAL}, extra=d)
    L, F = s.freq.shape
    for k in ("mean_abs", "mean_abs_up", "down_norm", "impact"):
        if getattr(s, k).shape != (L, F):
            raise ArgumentError(f"{path}: {k} has shape {getattr(s, k).shape}, expected {(L, F)}")
    if s.threshold.shape != (L,):
        raise ArgumentError(f"{path}: threshold has shape {s.threshold.shape}, expected {(L,)}")
    if s.is_moe:
        X = s.expert_count.shape[1] if s.expert_count.ndim == 2 else -1
        want = {"expert_count": (L, X), "expert_weight": (L, X), "expert_next": (L, X, X)}
        for k, shape in want.items():
            a = getattr(s, k)
            if a is None or a.shape != shape:
                raise ArgumentError(f"{path}: {k} has shape {None if a is None else a.shape}, expected {shape}")
        if s.expert_freq is None or s.expert_freq.shape[:2] != (L, X):
            raise ArgumentError(f"{path}: expert_freq is missing or not [{L}, {X}, n_ff_exp]")
    return s
