"""Where a step's time goes, device by device: `optiml bench --timeline`, Model.timeline().

The engine times every op and copy where it runs (the host's ops on the calling thread, a second CPU
device's on its worker, a GPU's between CUDA events) and every wait of one device for another. (On a GPU
the host's wait for a copy into pageable memory happens inside the copy call: it shows as a gap in the
host's row rather than as a wait. Ops that queue copies of their own, a GPU's attention, count those twice
in the per-kind sums, not in busy time.) From those
spans this module builds, per layer, how long each device was busy, how long copies and waits took, and how
long both devices computed at the same time (the overlap that hybrid execution exists for). It also writes
the spans as a Chrome trace (chrome://tracing, https://ui.perfetto.dev).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..util import jsonout

__all__ = ["Timeline", "LayerTimes", "record_steps"]

COPIES = ("copy_in", "copy_out", "copy")


def _union(intervals: list) -> list:
    """Sorted, merged [t0, t1] intervals."""
    out: list = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals: list) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: list, y: list) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            total += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class LayerTimes:
    """Seconds, summed over the recorded steps. busy excludes waits; copies are part of the device's busy."""

    layer: int  # -1: outside the layers (embedding, logits)
    host_busy: float = 0.0
    device_busy: float = 0.0
    copies: float = 0.0
    host_wait: float = 0.0
    device_wait: float = 0.0
    overlap: float = 0.0  # both devices busy at once (the device's copies count as busy)
    host_ops: dict = field(default_factory=dict)  # kind -> seconds
    device_ops: dict = field(default_factory=dict)


class Timeline:
    """Spans of the steps run while recording: (device, layer, kind, t0, t1), device 0 the host and 1 the
    plan's device; times in seconds of the host's steady clock."""

    def __init__(self, spans: list, devices: tuple, n_tokens: int):
        self.spans = [tuple(s) for s in spans]
        self.devices = devices  # names: ("cpu",) or ("cpu", "cuda:0")
        self.n_tokens = n_tokens  # tokens decoded while recording (the steps)

    @property
    def wall(self) -> float:
        """Seconds from the first span's start to the last one's end (between steps: the caller's own time,
        e.g. Model.timeline's greedy pick, is included)."""
        if not self.spans:
            return 0.0
        return max(s[4] for s in self.spans) - min(s[3] for s in self.spans)

    def layers(self) -> list[LayerTimes]:
        by_layer: dict = {}
        for dev, layer, kind, t0, t1 in self.spans:
            by_layer.setdefault(layer, []).append((dev, kind, t0, t1))
        rows = []
        for layer in sorted(by_layer):
            r = LayerTimes(layer)
            busy = {0: [], 1: []}
            for dev, kind, t0, t1 in by_layer[layer]:
                d = t1 - t0
                ops = r.host_ops if dev == 0 else r.device_ops
                ops[kind] = ops.get(kind, 0.0) + d
                if kind == "wait":
                    if dev == 0:
                        r.host_wait += d
                    else:
                        r.device_wait += d
                    continue
                busy[dev].append([t0, t1])
                if kind in COPIES:
                    r.copies += d
            hb, db = _union(busy[0]), _union(busy[1])
            r.host_busy, r.device_busy = _length(hb), _length(db)
            r.overlap = _intersection(hb, db)
            rows.append(r)
        return rows

    def totals(self, rows: list[LayerTimes] | None = None) -> LayerTimes:
        """The sums over the layers (rows: self.layers(), when already computed)."""
        t = LayerTimes(-2)
        for r in self.layers() if rows is None else rows:
            for name in ("host_busy", "device_busy", "copies", "host_wait", "device_wait", "overlap"):
                setattr(t, name, getattr(t, name) + getattr(r, name))
        return t

    def __str__(self) -> str:
        n = max(self.n_tokens, 1)
        dev = self.devices[1] if len(self.devices) > 1 else None
        ms = lambda s: f"{s / n * 1e3:8.3f}"  # noqa: E731 - per step, milliseconds
        lines = [f"timeline: {self.n_tokens} step(s), {self.wall / n * 1e3:.3f} ms per step; per layer and step, ms "
                 f"(host {self.devices[0]}" + (f", device {dev})" if dev else ")")]
        head = f"{'layer':>5} {'host busy':>9} {'host wait':>9}"
        if dev:
            head += f" {'dev busy':>8} {'copies':>8} {'dev wait':>8} {'overlap':>8}"
        lines.append(head + "  ops on the host" + (" | on the device" if dev else ""))
        rows = self.layers()
        t = self.totals(rows)
        for r in rows + [t]:
            name = "total" if r.layer == -2 else ("-" if r.layer == -1 else str(r.layer))
            line = f"{name:>5} {ms(r.host_busy):>9} {ms(r.host_wait):>9}"
            if dev:
                line += f" {ms(r.device_busy)} {ms(r.copies)} {ms(r.device_wait)} {ms(r.overlap)}"
            if r.layer != -2:
                line += "  " + " ".join(f"{k} {v / n * 1e3:.3f}" for k, v in r.host_ops.items() if k != "wait")
                if dev and r.device_ops:
                    line += " | " + " ".join(f"{k} {v / n * 1e3:.3f}" for k, v in r.device_ops.items() if k != "wait")
            lines.append(line)
        if dev:
            both = min(t.host_busy, t.device_busy)
            lines.append(f"overlap: {t.overlap / n * 1e3:.3f} ms per step, "
                         f"{(t.overlap / both if both else 0.0):.0%} of the shorter device's busy time")
        return "\n".join(lines)

    def to_chrome_trace(self, path: str | os.PathLike) -> None:
        """Writes the spans as Chrome trace events (one row per device)."""
        if not self.spans:
            raise ValueError("the timeline is empty: nothing ran while it was recorded")
        origin = min(s[3] for s in self.spans)
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": name}}
                  for i, name in enumerate(self.devices)]
        for dev, layer, kind, t0, t1 in self.spans:
            events.append({"name": kind if layer < 0 else f"{kind} {layer}", "cat": kind, "ph": "X", "pid": 0,
                           "tid": dev, "ts": (t0 - origin) * 1e6, "dur": (t1 - t0) * 1e6, "args": {"layer": layer}})
        with open(path, "w", encoding="utf-8") as f:
            jsonout.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def record_steps(session, ids: list[int], n_tokens: int, batch: int = 1) -> list:
    """The spans of n_tokens greedy decode steps after the prompt ``ids`` (batch > 1: steps of the prompt's
    last `batch` tokens again, as in prompt processing), timed by the native session, which holds only
    what this runs."""
    logits = session.eval(np.asarray(ids, np.int32), False)
    session.timeline_start()
    try:
        for _ in range(n_tokens):
            step = np.asarray(ids[-batch:] if batch > 1 else [int(np.argmax(logits))], np.int32)
            if len(step) < batch:
                step = np.resize(step, batch)
            logits = session.eval(step, False)
    finally:
        spans = session.timeline_stop()
    return spans
