"""Whether the sparse FFN is faster than the dense one on this machine, for sparsity="auto".

Skipping neurons only pays when the rows it skips cost more than the work of choosing them. On a large
model (7B shapes: 2-4 KB rows) it nearly always does; on a small one (SmolLM2: 360-byte rows, 0.2 ms an
FFN) the dense kernels over their interleaved copies can outrun the sparse path at 50% sparsity. Which one
wins depends on the machine's memory, its cores and the thread count, so it is measured, not guessed: a
few single-token steps of a fixed text with the sparse FFN and with the dense one, in rounds that alternate
which goes first. Sparse is kept only when it wins nearly every round by the margin: a machine busy with
other work can slow one phase and not the next, and a verdict taken from such a moment would keep a slower
path. A clear verdict is cached per machine, model file, settings and thread count in
$OPTIML_HOME/sparsity-speed.json, so a model is timed once per machine and later loads decide the same way
(outputs do not change from one run to the next); rounds that disagree give the dense FFN for this load and
are timed again at the next. OPTIML_SPARSITY_PROBE=off skips the measurement: the file's sparsity is then
used as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

from ..util.atomic import atomic_output
from ..util.machine import cpu_name
from ..util.paths import optiml_home

__all__ = ["Verdict", "sparse_pays", "cache_path"]

# Sparse must be this much faster to be kept: within it the two are a tie, and a tie goes to the dense
# FFN, which costs no accuracy.
MARGIN = 1.03
# Seconds of single-token steps per phase (ten phases: dense and sparse, five rounds), at least one step.
PHASE_BUDGET_S = 0.1
ROUNDS = 5
# Rounds sparse must win (by MARGIN) to be kept; a verdict is cached when at least this many rounds agree
# on the winner (else the machine was too noisy to tell, and the next load times it again).
WINS_NEEDED = 4
MAX_STEPS = 16
PROBE_TEXT = ("It was a dark and stormy night; the rain fell in torrents, except at occasional intervals, "
              "when it was checked by a violent gust of wind which swept up the streets.")


@dataclass
class Verdict:
    pays: bool  # keep the sparse FFN
    dense_ms: float  # median time of a single-token step, dense (nan when not measured)
    sparse_ms: float
    note: str  # one line for people: what was decided and why
    cached: bool = False


def cache_path() -> str:
    return os.path.join(os.fspath(optiml_home()), "sparsity-speed.json")


def _file_id(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.abspath(path)}:{st.st_size}:{int(st.st_mtime)}"


def _key(model, config: str) -> str:
    """The machine, the files (path, size, time: a rewritten file is timed again), the settings."""
    parts = [cpu_name(), str(model._n_threads), _file_id(model.path), config, model.plan.device,
             f"group {model.predictor_group}", f"placed copies {model._session.placed_copies}"]
    if model.predictors:
        parts.append(_file_id(model.predictors))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _read_cache() -> dict:
    try:
        with open(cache_path(), encoding="utf-8") as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, v: Verdict) -> None:
    d = _read_cache()
    d[key] = {k: val for k, val in asdict(v).items() if k != "cached"}
    try:
        os.makedirs(os.path.dirname(cache_path()), exist_ok=True)
        with atomic_output(cache_path(), suffix=".json") as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(d, f, indent=1, sort_keys=True)
    except OSError:  # a read-only home: the verdict holds for this process only
        pass


def _phase(model, ids: list[int], steps: int) -> float:
    """Median seconds of `steps` single-token steps after the first token of ids (the context emptied first)."""
    model.reset()
    model.eval(ids[:1])
    times = []
    for t in ids[1:1 + steps]:
        t0 = time.perf_counter()
        model.eval([t])
        times.append(time.perf_counter() - t0)
    model.reset()
    return statistics.median(times)


def sparse_pays(model, config: str, use_dense, use_sparse) -> Verdict:
    """Times `model` with its FFN dense (use_dense() switches to it) and sparse (use_sparse()), leaving it
    sparse; config names the sparse settings for the cache key. The context is emptied."""
    # Off means the file's sparsity as it is: a verdict cached by an earlier run does not apply either.
    if os.environ.get("OPTIML_SPARSITY_PROBE", "on").lower() in ("off", "0", "no"):
        return Verdict(True, float("nan"), float("nan"), "")  # nothing decided: nothing to say
    key = _key(model, config)
    hit = _read_cache().get(key)
    if isinstance(hit, dict):
        try:
            return Verdict(**hit, cached=True)
        except TypeError:
            pass
    ids = model.tokenize(PROBE_TEXT)[: model.n_ctx]  # a tiny context still holds a step or two
    if len(ids) < 2:
        return Verdict(True, float("nan"), float("nan"), "sparsity as the file sets it: the context is too short "
                       "to time it against the dense FFN")
    first = _phase(model, ids, 3)  # also pages the sparse path's weights in
    steps = max(1, min(MAX_STEPS, len(ids) - 1, int(PHASE_BUDGET_S / max(first, 1e-6))))
    dense, sparse = [], []
    for r in range(ROUNDS):  # which one goes first alternates, so a drifting machine favours neither
        for mode in (("dense", "sparse") if r % 2 == 0 else ("sparse", "dense")):
            if mode == "dense":
                use_dense()
                dense.append(_phase(model, ids, steps))
            else:
                use_sparse()
                sparse.append(_phase(model, ids, steps))
    use_sparse()
    wins = sum(sp * MARGIN < de for sp, de in zip(sparse, dense))
    pays = wins >= WINS_NEEDED
    clear = pays or ROUNDS - wins >= WINS_NEEDED
    d, s = statistics.median(dense) * 1e3, statistics.median(sparse) * 1e3
    how = f"a step took {s:.2f} ms sparse and {d:.2f} ms dense on this machine (medians of {ROUNDS} rounds of " \
          f"{steps} steps; sparse {MARGIN - 1:.0%} or more faster in {wins} of them)"
    how += f"; cached in {cache_path()}" if clear else "; the rounds disagree (a busy machine?): timed again next load"
    note = ("the sparse FFN is used: " if pays else "the sparse FFN is not used, the dense one is faster or as fast: ") + how
    v = Verdict(pays, d, s, note)
    if clear:
        _write_cache(key, v)
    return v
