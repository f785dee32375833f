"""Which FFN neurons the sparse FFN skips: the sparsity mode and its thresholds, the activation predictors a
model picks up by itself, and the kind of neuron-major down copy both need. Policy only: Model applies what
these functions decide to its native session."""

from __future__ import annotations

import collections
import os
import warnings

import numpy as np

from .._core import ArgumentError
from ..formats.predictors import check_predictors, default_predictor_path, predicted_share
from ..util import memory

__all__ = ["PredictorWarning", "SkipMeter", "beside", "break_even_share", "choose_mode", "compact_down", "describe",
           "format_skipped", "predictors_beside", "skip_stats"]


class PredictorWarning(UserWarning):
    """Predictors found beside a model (predictors="auto") and left unused: they would slow it down."""


# The mean share of neurons predicted active above which predictors make decoding slower than the dense FFN
# (7B-shaped Q4_0, 2 threads, AVX-512, tools/bench_predictors.py --levels-speed, tokens/s). The predicted
# rows are scattered and stream at about half the rate of the dense kernels' sequential ones. A gated FFN
# reads gate, up and down for every predicted neuron: 40% predicted ran 12.2-12.5, 50% 10.3-10.9, the dense
# path 11.6 in the machine's faster phases (8.5 in its slower ones). A ReLU FFN reads up and down only for
# the predicted neurons whose gate fires: 70% predicted 12.2, 80% 11.2, dense 11.5 in a faster phase.
_BREAK_EVEN = {"gated": 0.45, "relu": 0.8}


def is_relu(activation: str) -> bool:
    """A ReLU-family FFN: its neurons are exactly zero when inactive."""
    return activation in ("relu", "relu2")


def break_even_share(activation: str) -> float:
    """The mean share of FFN neurons predicted active above which predictors slow decoding down (see
    _BREAK_EVEN): predictors="auto" leaves such a file unused."""
    return _BREAK_EVEN["relu" if is_relu(activation) else "gated"]


def choose_mode(mode: str, thresholds, criterion: str | None, cfg: dict, hparams: dict, path: str) -> tuple:
    """Model.set_sparsity's decision: (mode in use, per-layer thresholds or None, whether the criterion is
    "product", per-neuron scales or None). cfg: the file's calibrated sparsity (native Model.sparsity)."""
    if mode not in ("none", "threshold", "auto"):
        raise ArgumentError(f"sparsity must be 'none', 'threshold' or 'auto', not {mode!r}")
    if criterion not in (None, "gate", "product"):
        raise ArgumentError(f"criterion must be 'gate' or 'product', not {criterion!r}")
    n_layer = hparams["n_layer"]
    scale = None
    if mode == "none":
        chosen, thr = "none", None
    elif thresholds is not None:
        thr = np.asarray(thresholds, dtype=np.float32)
        if thr.ndim == 0:
            thr = np.full(n_layer, float(thr), dtype=np.float32)
        if thr.shape != (n_layer,):
            raise ArgumentError(f"thresholds: give one value or {n_layer} (one per layer), not {thr.size}")
        if not np.all(np.isfinite(thr)) or np.any(thr < 0):
            raise ArgumentError("thresholds must be finite and >= 0")
        chosen = "custom"
    elif cfg["calibrated"]:
        chosen, thr = "calibrated", np.asarray(cfg["threshold"], dtype=np.float32)
        criterion = criterion or cfg["criterion"]
        if criterion == "gate" and cfg["neuron_scale"] is not None:
            scale = cfg["neuron_scale"]
    elif is_relu(hparams["ffn_act"]):
        chosen, thr = "exact", np.zeros(n_layer, dtype=np.float32)
    elif mode == "threshold":
        raise ArgumentError(
            f"{os.path.basename(path)} carries no sparsity thresholds and its FFN ({hparams['ffn_act']}) "
            "is not ReLU-family: run `optiml calibrate` on it (or give Model its thresholds=)")
    else:
        chosen, thr = "none", None
    return chosen, thr, (criterion or "gate") == "product", scale


def compact_down(down_copy: str, share: float | None, hparams: dict) -> bool:
    """Whether the sparse FFN's neuron-major down copies are compact (grouped: lossless, about the
    matrix's own size, for Q4_0/Q4_1/Q4_K) rather than fast (8-bit rows: about twice a 4-bit matrix).
    Summing them (tools/bench_sparse_kernels.py --parts down, 7B shapes, 2 threads, AVX-512): fast
    takes 0.5x compact's time at 5% of the neurons, 0.65x at 10%, 0.85x at 20%; compact is 10-25%
    faster at 40%, 20-25% at 50% (where fast loses to the dense kernel, compact does not). Compact
    is also the smaller copy, so the crossover is put at 40%. down_copy "auto": compact when the
    predictors in use (share: the mean share of neurons they predicted active on held-out tokens, as
    predicted_share reads it from their file) mark at least 40% of a gated FFN's neurons active (a ReLU
    FFN sums only the predicted neurons that fire: far fewer), or when the 8-bit copies would take more
    than half of the memory now available; else fast."""
    if down_copy != "auto":
        return down_copy == "compact"
    if share is not None and not is_relu(hparams["ffn_act"]) and share >= 0.4:
        return True
    need = hparams["n_layer"] * hparams["n_ff"] * hparams["n_embd"] * 34 / 32  # Q8_0: 34 bytes per 32 weights
    available = memory.memory_available()
    if available is None:  # no way to tell: favour speed
        return False
    return need > available / 2


def beside(model_path: str, activation: str) -> dict:
    """What predictors="auto" makes of MODEL.predictors.gguf beside the model, without warning: path,
    found, used (whether a Model would use it), why (the reason in words), predicted_share (of the FFN
    neurons its predictors marked active on held-out text; None when the file does not say), break_even
    (break_even_share) and meta (the checked metadata, when found). PredictorMismatchError (an
    OptimlError) for a file trained for another model: a Model with predictors="auto" refuses to load then."""
    path = default_predictor_path(model_path)
    limit = break_even_share(activation)
    d = {"path": path, "found": os.path.isfile(path), "used": False, "predicted_share": None, "break_even": limit,
         "meta": None}
    if not d["found"]:
        d["why"] = "none beside the model (optiml train-predictors writes one there)"
        return d
    meta = d["meta"] = check_predictors(path, model_path, activation)
    share = d["predicted_share"] = predicted_share(meta)
    if share is not None and share > limit:
        d["why"] = (f"its predictors mark {share:.1%} of the FFN neurons active on held-out text, and above about "
                    f"{limit:.0%} the sparse FFN is slower than the dense one")
    else:
        d["used"] = True
        d["why"] = ("predictors='auto' uses the file beside the model" +
                    (f" ({share:.1%} of the neurons predicted active on held-out text, under {limit:.0%})"
                     if share is not None else ""))
    return d


def predictors_beside(model_path: str, activation: str) -> tuple[str, dict] | None:
    """MODEL.predictors.gguf beside the model and its checked metadata, when it exists and would make
    decoding faster (see beside). A file whose predictors mark more neurons active on held-out text than
    break_even_share allows is left unused, with a PredictorWarning (predictors=PATH still uses it),
    attributed to the code that made the Model (this is called from Model.__init__)."""
    d = beside(model_path, activation)
    if d["found"] and not d["used"]:
        warnings.warn(f"not using {d['path']}: {d['why']}; name the file (predictors=PATH, or --predictors PATH on "
                      "the command line) to use them anyway", PredictorWarning, stacklevel=3)
    return (d["path"], d["meta"]) if d["used"] else None


def skip_stats(active: np.ndarray, seen: np.ndarray, mode: str, hparams: dict, predictors: str | None = None) -> dict:
    """Model.sparsity_stats from the session's per-layer counts of (token, neuron) pairs computed and seen."""
    per_layer = [1.0 - a / s if s else 0.0 for a, s in zip(active.tolist(), seen.tolist())]
    total = int(seen.sum())
    return {"mode": mode, "predictors": predictors, "skipped": 1.0 - int(active.sum()) / total if total else 0.0,
            "layers": per_layer, "tokens": total // hparams["n_ff"] // max(1, hparams["n_layer"])}


_MODE_WORDS = {"none": "dense", "calibrated": "the file's calibrated thresholds", "exact": "ReLU zeros skipped",
               "custom": "thresholds given"}


def describe(mode: str, predictors: str | None, note: str = "") -> str:
    """The sparsity in use in words, for a log line: "sparsity exact (ReLU zeros skipped), predictors NAME",
    then sparsity="auto"'s note on why (Model.sparsity_note) when there is one."""
    pred = os.path.basename(predictors) if predictors else "none"
    return f"sparsity {mode} ({_MODE_WORDS.get(mode, mode)}), predictors {pred}" + (f" [{note}]" if note else "")


class SkipMeter:
    """The share of FFN neurons skipped, step by step (Model.sparsity_meter): step() after each forward
    step (a prompt batch, a decoded token) records the share of that step's (token, neuron) pairs that
    were not computed; summary() gives the mean over all of them and the spread over the steps.

    counts: a callable returning the per-layer (computed, seen) counts (they only grow, unless reset:
    a reset starts the next step from zero). info: a callable returning (mode, predictors) now.
    history: how many of the last steps the spread is taken over (None: all; a server keeps a window)."""

    def __init__(self, counts, info, hparams: dict, history: int | None = None):
        self._counts = counts
        self._info = info
        self._per_token = hparams["n_ff"] * max(1, hparams["n_layer"])
        self._last = self._totals()
        self.active = self.seen = 0  # (token, neuron) pairs computed and seen over the recorded steps
        self.n_steps = 0
        self.recent: collections.deque[float] = collections.deque(maxlen=history)  # steps' shares skipped
        self.last: float | None = None

    def _totals(self) -> tuple[int, int]:
        active, seen = self._counts()
        return int(active.sum()), int(seen.sum())

    def step(self) -> float | None:
        """Closes a step: its share of neurons skipped (None when nothing ran since the last one)."""
        active, seen = self._totals()
        a0, s0 = self._last if seen >= self._last[1] else (0, 0)
        self._last = (active, seen)
        if seen == s0:
            return None
        self.last = 1.0 - (active - a0) / (seen - s0)
        self.active += active - a0
        self.seen += seen - s0
        self.n_steps += 1
        self.recent.append(self.last)
        return self.last

    @property
    def skipped(self) -> float | None:
        """The mean share skipped over every token of every recorded step (None before the first)."""
        return 1.0 - self.active / self.seen if self.seen else None

    def summary(self) -> dict:
        """mode, predictors (the file in use, or None), steps, tokens, skipped (the mean share over every
        token of every step; None when no step ran) and per_step: min, median, max (over the history)
        and last of the steps' shares (None without steps)."""
        mode, predictors = self._info()
        d = {"mode": mode, "predictors": predictors, "steps": self.n_steps, "tokens": self.seen // self._per_token,
             "skipped": self.skipped, "per_step": None}
        if self.recent:
            d["per_step"] = {"min": min(self.recent), "median": float(np.median(self.recent)),
                             "max": max(self.recent), "last": self.last}
        return d


def format_skipped(summary: dict) -> str:
    """A SkipMeter summary in words: "41.2%" for one step; "41.2% mean (per step 35.0% to 47.1%, median
    41.0%, 128 steps)" for several; "-" when nothing ran."""
    if summary["skipped"] is None:
        return "-"
    text = f"{summary['skipped']:.1%}"
    ps = summary["per_step"]
    if summary["steps"] > 1:
        text += (f" mean (per step {ps['min']:.1%} to {ps['max']:.1%}, median {ps['median']:.1%}, "
                 f"{summary['steps']} steps)")
    return text
