"""What a decode step launches on the device and the bytes it moves: `optiml bench --launches`, Model.launches().

The CUDA backend counts every kernel and copy its ops enqueue, per layer and kind, with the bytes each must
move at least (weights, activations, KV cache: native/src/cuda/kernels.cuh says how each is modelled), and
counts a recorded step (CUDA graph) that is launched again as the kernels it holds. The counts are the same
on the CPU emulator as on a GPU, so fusing kernels shows on any machine. Devices that count nothing (the
CPU ones) give an empty table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Launches", "count_steps"]

FIELDS = ("launches", "weight_bytes", "activation_bytes", "kv_bytes")


def _mib(b: float) -> str:
    return f"{b / 2**20:.3f} MiB" if b < 2**30 else f"{b / 2**30:.3f} GiB"


@dataclass
class Launches:
    """rows: (layer, kind, is_copy, launches, weight_bytes, activation_bytes, kv_bytes) summed over n_steps
    steps of `batch` tokens each (layer -1: outside the layers, the logits); host_launches: the calls that
    put work on the stream (a kernel, a copy, or a whole recorded step)."""

    rows: list
    device: str
    n_steps: int
    batch: int
    host_launches: int
    n_layer: int
    positions: tuple = ()  # the first and last position decoded

    @property
    def n_tokens(self) -> int:
        return self.n_steps * self.batch

    def _sum(self, rows, per: float) -> dict:
        out = dict.fromkeys(FIELDS, 0.0)
        for r in rows:
            for i, f in enumerate(FIELDS):
                out[f] += r[3 + i]
        return {k: v / per for k, v in out.items()}

    def per_token(self) -> dict:
        """Kernels (not copies) and copies per token, bytes per token by kind of memory, host calls per token."""
        n = max(self.n_tokens, 1)
        k = self._sum([r for r in self.rows if not r[2]], n)
        c = self._sum([r for r in self.rows if r[2]], n)
        return {"kernels": k["launches"], "copies": c["launches"], "host_launches": self.host_launches / n,
                "weight_bytes": k["weight_bytes"], "activation_bytes": k["activation_bytes"] + c["activation_bytes"],
                "kv_bytes": k["kv_bytes"]}

    def per_step(self) -> dict:
        """As per_token, per step of `batch` tokens."""
        return {k: v * self.batch for k, v in self.per_token().items()}

    def by_kind(self) -> dict:
        """kind -> per-step sums (launches, bytes)."""
        kinds: dict = {}
        for r in self.rows:
            kinds.setdefault(r[1], []).append(r)
        return {k: self._sum(v, max(self.n_steps, 1)) for k, v in sorted(kinds.items())}

    def layer(self, layer: int) -> dict:
        """kind -> per-step sums of one layer (-1: outside the layers)."""
        return {r[1]: self._sum([r], max(self.n_steps, 1)) for r in self.rows if r[0] == layer}

    def to_dict(self) -> dict:
        return {"device": self.device, "n_steps": self.n_steps, "batch": self.batch, "n_layer": self.n_layer,
                "positions": list(self.positions), "per_token": self.per_token(), "per_step": self.per_step(),
                "by_kind": self.by_kind(), "layers": {str(l): self.layer(l) for l in sorted({r[0] for r in self.rows})}}

    def __str__(self) -> str:
        if not self.rows:
            return f"launches: {self.device} counts none (the CUDA backend counts its kernels; run with --device cuda)"
        t, s = self.per_token(), self.per_step()
        pos = f" at positions {self.positions[0]}..{self.positions[1]}" if self.positions else ""
        lines = [f"launches on {self.device}: {self.n_steps} step(s) of {self.batch} token(s){pos}",
                 f"per token: {t['kernels']:.1f} kernels ({t['kernels'] / max(self.n_layer, 1):.2f} per layer), "
                 f"{t['copies']:.1f} copies, {t['host_launches']:.2f} host calls; weights {_mib(t['weight_bytes'])}, "
                 f"activations {_mib(t['activation_bytes'])}, KV {_mib(t['kv_bytes'])}"]
        if self.batch > 1:
            lines.append(f"per step: {s['kernels']:.1f} kernels, weights {_mib(s['weight_bytes'])}")
        lines.append("per step, by kind:")
        lines.append(f"  {'kind':<18} {'launches':>9} {'weights':>14} {'activations':>14} {'kv':>14}")
        for kind, v in self.by_kind().items():
            lines.append(f"  {kind:<18} {v['launches']:9.1f} {_mib(v['weight_bytes']):>14} "
                         f"{_mib(v['activation_bytes']):>14} {_mib(v['kv_bytes']):>14}")
        lines.append("per step, by layer (runs of equal layers as one row, values per layer):")
        layers = sorted({r[0] for r in self.rows})
        groups: list = []  # [first, last, kinds]
        for layer in layers:
            kinds = self.layer(layer)
            key = {k: (v["launches"], v["weight_bytes"]) for k, v in kinds.items()}
            if groups and layer >= 0 and groups[-1][1] == layer - 1 and groups[-1][3] == key:
                groups[-1][1] = layer
            else:
                groups.append([layer, layer, kinds, key])
        for first, last, kinds, _ in groups:
            name = "-" if first < 0 else (str(first) if first == last else f"{first}-{last}")
            tot = self._sum([(0, "", False, *(v[f] for f in FIELDS)) for v in kinds.values()], 1)
            ops = " ".join(f"{k} {v['launches']:g}" for k, v in kinds.items())
            lines.append(f"  {name:>7} {tot['launches']:6g} launches, weights {_mib(tot['weight_bytes'])}, "
                         f"KV {_mib(tot['kv_bytes'])}: {ops}")
        return "\n".join(lines)


def count_steps(session, ids: list[int], n_steps: int, batch: int = 1) -> tuple[list, int, tuple]:
    """The launch counts of n_steps greedy decode steps after the prompt ``ids`` (batch > 1: steps of the
    prompt's last `batch` tokens again, as Model.timeline runs them), and the host launches."""
    import numpy as np

    logits = session.eval(np.asarray(ids, np.int32), False)
    first = len(ids)
    session.reset_launch_counts()
    for _ in range(n_steps):
        step = np.asarray(ids[-batch:] if batch > 1 else [int(np.argmax(logits))], np.int32)
        if len(step) < batch:
            step = np.resize(step, batch)
        logits = session.eval(step, False)
    return session.launch_counts(), session.host_launches, (first, first + n_steps * batch - 1)
