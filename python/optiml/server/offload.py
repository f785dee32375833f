"""When to put a sequence's attention on the CPU (issue #19, after NEO, MLSys 2025).

With `--kv-vram`, the device holds the KV cache of only so many sequences. A request that arrives when
every device slot is taken by a running sequence either waits for one (GPU-only: the batch stays what the
device holds) or starts at once with its KV cache in host memory, its attention computed by the CPU
while the device runs the linear layers (the pipelined step of forward_offload.cpp). Starting it adds a
token to every step and makes the step slower by the CPU's attention and the transfers: worth it when
the step's tokens per second go up and the step stays within the latency bound (`--max-itl-ms`).

The cost model is calibrated by measurement: every step's wall time is recorded with its features
(tokens, KV positions attended on the device and on the host, whether the host took part), and step
time is fitted by least squares on recent steps of each kind:

    GPU-only:  t = a0 + a1 * tokens + a2 * kv_device
    pipelined: t = b0 + b1 * tokens + b2 * kv_device + b3 * kv_host

Until a kind has enough steps to fit, admissions on the host are allowed (they are what produces
pipelined steps to learn from), as long as a latency bound, when given, has not already been seen
broken by such steps. Once sequences run on the host, a device slot freed by a finishing sequence goes
to one of them (moving its KV cache back), so the host only carries what the device cannot.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

MIN_FIT = 8  # steps of a kind before its fitted model is used
WINDOW = 256  # recent steps of each kind that the fit reads


@dataclass
class StepFeatures:
    tokens: int  # tokens in the step
    kv_device: int  # positions attended over by device-resident sequences (sum over their tokens)
    kv_host: int  # positions attended over by host-resident sequences

    @property
    def pipelined(self) -> bool:
        return self.kv_host > 0


class CostModel:
    """Step time as a linear function of the step's features, fitted on measured steps."""

    def __init__(self):
        self.steps = {False: collections.deque(maxlen=WINDOW), True: collections.deque(maxlen=WINDOW)}
        self._coef = {False: None, True: None}

    def observe(self, f: StepFeatures, seconds: float) -> None:
        self.steps[f.pipelined].append((f, seconds))
        self._coef[f.pipelined] = None

    def ready(self, pipelined: bool) -> bool:
        return len(self.steps[pipelined]) >= MIN_FIT

    @staticmethod
    def _row(f: StepFeatures, pipelined: bool) -> list:
        return [1.0, f.tokens, f.kv_device] + ([f.kv_host] if pipelined else [])

    def predict(self, f: StepFeatures) -> float | None:
        """Seconds the step would take; None until enough steps of its kind were measured."""
        p = f.pipelined
        if not self.ready(p):
            return None
        if self._coef[p] is None:
            x = np.array([self._row(g, p) for g, _ in self.steps[p]], np.float64)
            y = np.array([t for _, t in self.steps[p]], np.float64)
            # Non-negative costs: a least-squares fit on few, similar steps can give a feature a negative
            # weight that would make more work look cheaper. Clamp, then refit the intercept.
            coef = np.linalg.lstsq(x, y, rcond=None)[0]
            coef[1:] = np.maximum(coef[1:], 0.0)
            coef[0] = max(float(np.mean(y - x[:, 1:] @ coef[1:])), 0.0)
            self._coef[p] = coef
        return float(np.dot(self._coef[p], self._row(f, p)))

    def worst(self, pipelined: bool) -> float:
        """The slowest measured step of a kind (0 when none)."""
        return max((t for _, t in self.steps[pipelined]), default=0.0)


class OffloadPolicy:
    """Admits a sequence on the host when that raises the predicted throughput within the latency bound."""

    def __init__(self, max_itl_s: float | None = None):
        self.max_itl_s = max_itl_s
        self.cost = CostModel()
        self.last = None  # (decision, predicted seconds now, predicted seconds with the sequence) for /metrics

    def admit_on_host(self, now: StepFeatures, added_kv: int) -> bool:
        """now: the features of the running batch's next step; added_kv: the positions the new sequence
        would attend over in its first generating step (its prompt length)."""
        after = StepFeatures(now.tokens + 1, now.kv_device, now.kv_host + added_kv)
        if not now.tokens:
            # Nothing runs, so no device slot will free up for it (with one free, the host is not asked):
            # waiting would wait forever, and there is nobody's latency to protect.
            self.last = ("host: idle", 0.0, self.cost.predict(after))
            return True
        t_now = self.cost.predict(now)
        t_after = self.cost.predict(after)
        if t_after is None or t_now is None:
            # Not calibrated yet: learn by doing, unless pipelined steps already broke the bound.
            ok = self.max_itl_s is None or self.cost.worst(True) <= self.max_itl_s
            self.last = ("explore" if ok else "wait", t_now, t_after)
            return ok
        if self.max_itl_s is not None and t_after > self.max_itl_s:
            self.last = ("wait: latency bound", t_now, t_after)
            return False
        gain = after.tokens / t_after > (now.tokens / t_now if now.tokens and t_now > 0 else 0.0)
        self.last = ("host" if gain else "wait: no throughput gain", t_now, t_after)
        return gain
