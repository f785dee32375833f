"""The machine as `optiml solve` sees it: memory bandwidths and the costs of splitting a layer.

Defaults describe a typical desktop (dual-channel DDR5 CPU, a PCIe 4 consumer GPU):

    cpu_bandwidth    50e9   bytes/s  CPU memory read bandwidth (sparse FFN rows on the CPU are bandwidth-bound)
    gpu_bandwidth   900e9   bytes/s  GPU memory read bandwidth
    transfer_latency 10e-6  s        one PCIe transfer: the CPU's partial FFN output (one n_embd vector) to the GPU
    sync_cost        10e-6  s        waiting for and joining the CPU and GPU halves of a split layer
    launch_overhead   5e-6  s        kernel launches of a layer that has any neurons on the GPU
    gpu_memory          0   bytes    the device's memory (informational; 0: unknown)
    transfer_bandwidth 25e9 bytes/s  large host <-> GPU copies (informational: a token's copies are small)
    cpu_sparse         {}   type -> bytes/s of the CPU's row-sparse FFN product over the rows it reads
    cpu_dense          {}   type -> bytes/s of the CPU's dense product (matrix-vector)
    cpu_sparse_down     0   bytes/s of the sparse FFN's down projection: 8-bit neuron-major rows summed (0: not
                            measured; the FFN type's row-sparse rate stands in)

A layer that is split between the devices pays transfer_latency + sync_cost (Hardware.split_cost) per token.
When cpu_sparse has the model's FFN type, `optiml solve` times the CPU's share with it instead of
cpu_bandwidth (for_type): on a machine whose cores cannot keep up with its memory that rate is the lower.

`optiml hw [--device cuda|cpu:1] -o HW.json` measures all of these (Hardware.measure) into a file that
`optiml solve --hardware HW.json` reads.

A JSON file given to `optiml solve --hardware FILE` holds any subset of these keys, e.g.
    {"cpu_bandwidth": 80e9, "gpu_bandwidth": 1.0e12, "sync_cost": 2e-5}
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from .. import _core
from .._core import ArgumentError
from ..formats.quant import quantize, type_info
from ..util import jsonout

__all__ = ["Hardware"]

# Ops a device queues for one layer's FFN share: gate and up products, their biases, the activation, down.
FFN_SHARE_OPS = 6


@dataclass
class Hardware:
    cpu_bandwidth: float = 50e9
    gpu_bandwidth: float = 900e9
    transfer_latency: float = 10e-6
    sync_cost: float = 10e-6
    launch_overhead: float = 5e-6
    gpu_memory: int = 0
    transfer_bandwidth: float = 25e9
    cpu_sparse: dict = field(default_factory=dict)
    cpu_dense: dict = field(default_factory=dict)
    cpu_sparse_down: float = 0.0
    source: str = "defaults"  # where the numbers came from, for the report

    def __post_init__(self) -> None:
        for name in ("cpu_sparse", "cpu_dense"):
            d = getattr(self, name)
            if not isinstance(d, dict) or any(
                    not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float))
                    or not math.isfinite(v) or v <= 0 for k, v in d.items()):
                raise ArgumentError(f"hardware: {name} must map type names to bytes/s > 0, not {d!r}")
            setattr(self, name, {k.lower(): float(v) for k, v in d.items()})
        for f in fields(self):
            if f.name in ("source", "cpu_sparse", "cpu_dense"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ArgumentError(f"hardware: {f.name} must be a finite number >= 0, not {v!r}")
            if f.name.endswith("bandwidth") and v <= 0:
                raise ArgumentError(f"hardware: {f.name} must be > 0, not {v!r}")
        self.gpu_memory = int(self.gpu_memory)

    @property
    def split_cost(self) -> float:
        """Seconds per token added by a layer split between the CPU and the GPU."""
        return self.transfer_latency + self.sync_cost

    @property
    def op_cost(self) -> float:
        """Seconds per op the device queues (launch_overhead holds a FFN share's FFN_SHARE_OPS of them)."""
        return self.launch_overhead / FFN_SHARE_OPS

    def to_dict(self) -> dict:
        return asdict(self)

    def for_type(self, ffn_type: str) -> Hardware:
        """This hardware with cpu_bandwidth set to the CPU's measured sparse rate for FFN weights of
        ffn_type (itself when that type was not measured)."""
        rate = self.cpu_sparse.get(ffn_type.lower())
        if rate is None:
            return self
        return replace(self, cpu_bandwidth=rate, source=f"{self.source}; CPU share timed at its {ffn_type} rate")

    def save(self, path: str | os.PathLike) -> None:
        d = self.to_dict()
        d.pop("source")
        with open(path, "w", encoding="utf-8") as f:
            jsonout.dump(d, f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def measure(cls, device: str | None = None, types=("q4_0", "q4_1", "q4_k", "q8_0"), weight_bytes: int = 256 << 20,
                n_threads: int = 0, density: float = 0.1, progress=None) -> Hardware:
        """Measures this machine: the CPU's read bandwidth, its dense and row-sparse (at `density` of the
        rows) product rates per weight type over `weight_bytes` of weights, and with `device` ("cuda[:N]",
        or "cpu:N" to exercise the path without a GPU) the device's memory traffic, copy latency and
        bandwidth, event round trip and per-op overhead (optiml._core.measure_device). Takes a few
        seconds per type."""
        say = progress or (lambda msg: None)
        if not 0 < density <= 1:
            raise ArgumentError(f"density must be in (0, 1], not {density!r}")
        if device is not None and device.startswith("cuda"):  # said now, not after a minute of CPU timings
            info = _core.system_info()
            index = device.partition(":")[2]
            if not index.isdigit() and index != "" or int(index or 0) >= len(info["cuda_devices"]):
                raise ArgumentError(f"device '{device}': no such CUDA device here ({info['cuda_note'] or 'none found'}); "
                                    "leave out --device to measure the CPU alone")
        infos = [(t, type_info(t)) for t in types]  # an unknown type said now, not after the bandwidth's timing
        hw = cls()
        say("CPU read bandwidth")
        hw.cpu_bandwidth = float(_core.measure_read_bandwidth(max(weight_bytes, 1 << 20) * 4, 3, n_threads))
        rng = np.random.default_rng(0)
        cols = 4096
        x = rng.standard_normal((1, cols)).astype(np.float32)
        for t, info in infos:
            say(f"CPU {info.name} products")
            block = quantize(rng.standard_normal((256, cols)).astype(np.float32) * 0.05, t)
            rows = max(256, weight_bytes // block.shape[1] // 256 * 256)
            w = np.ascontiguousarray(np.tile(block, (rows // 256, 1)))  # values repeat; the traffic does not
            n_idx = max(1, int(rows * density))
            _core.matmul(w, info.id, x, "", n_threads)  # page the weights in
            dense = min(_timed(lambda: _core.matmul(w, info.id, x, "", n_threads)) for _ in range(5))
            sparse = 1e30
            for _ in range(5):  # other rows each time: the last run's rows may still be in the cache
                idx = np.sort(rng.choice(rows, n_idx, replace=False)).astype(np.int32)
                sparse = min(sparse, _timed(lambda: _core.matmul_rows(w, info.id, rows, cols, idx, x, n_threads)))
            hw.cpu_dense[info.name.lower()] = w.nbytes / dense
            hw.cpu_sparse[info.name.lower()] = n_idx * w.shape[1] / sparse
        say("CPU sparse down projection")
        hw.cpu_sparse_down = _sparse_down_rate(rng, weight_bytes, density, n_threads)
        measured = ["cpu_bandwidth", "cpu_dense", "cpu_sparse", "cpu_sparse_down"]
        if device is not None:
            say(f"device {device}")
            d = _core.measure_device(device, max(weight_bytes, 1 << 20) * 2, n_threads=max(n_threads, 1))
            hw.gpu_bandwidth = d["device_bytes_per_s"]
            # A layer whose data crosses makes two small copies (its FFN input out, the partial output back)
            # and waits once: the measured copy-and-wait less the wait, twice, and the wait.
            hw.sync_cost = d["sync_s"]
            hw.transfer_latency = 2 * max(d["transfer_latency_s"] - d["sync_s"], 0.0)
            hw.transfer_bandwidth = min(d["h2d_bytes_per_s"], d["d2h_bytes_per_s"])
            hw.launch_overhead = FFN_SHARE_OPS * d["op_s"]  # the ops a device's FFN share queues
            measured += ["gpu_bandwidth", "transfer_latency", "transfer_bandwidth", "sync_cost", "launch_overhead"]
            cuda = _core.system_info().get("cuda_devices", [])
            if d["device"].startswith("cuda") and cuda:
                hw.gpu_memory = int(cuda[int(d["device"].split(":")[1])]["total_memory"])
                measured.append("gpu_memory")
        hw.source = f"measured ({device or 'CPU only'}): " + ", ".join(measured)
        return hw

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Hardware:
        """Reads a JSON object with any of the fields above; unknown keys and bad values: ArgumentError. A
        `source` key (what a placed file records) is kept in the new source's words."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ArgumentError(f"hardware file not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ArgumentError(f"{path} is not a JSON hardware description: {e}") from None
        if not isinstance(d, dict):
            raise ArgumentError(f"{path}: expected a JSON object of hardware fields, not {type(d).__name__}")
        known = {f.name for f in fields(cls)} - {"source"}
        d = dict(d)
        was = d.pop("source", None)
        for k in d:
            if k not in known:
                raise ArgumentError(f"{path}: unknown hardware key {k!r}; known: {', '.join(sorted(known))}")
        try:
            return cls(**d, source=f"file {os.path.basename(path)}" + (f" ({was})" if isinstance(was, str) else ""))
        except ArgumentError as e:
            raise ArgumentError(f"{path}: {e}") from None

    @classmethod
    def auto(cls, measure_bytes: int = 256 << 20) -> Hardware:
        """Measures the CPU's read bandwidth (optiml._core.measure_read_bandwidth); takes the GPU's memory
        size from optiml.system_info()'s CUDA devices when there are any. The GPU bandwidth, latencies and
        overheads are not measured: they keep their defaults. `source` says which is which."""
        hw = cls()
        measured = []
        try:
            hw.cpu_bandwidth = float(_core.measure_read_bandwidth(measure_bytes, 3))
            measured.append("cpu_bandwidth")
        except Exception:  # noqa: BLE001 - a failed measurement leaves the default
            pass
        devices = _core.system_info().get("cuda_devices", [])
        if devices:
            hw.gpu_memory = int(devices[0]["total_memory"])
            measured.append(f"gpu_memory ({devices[0]['name']})")
        hw.source = ("measured: " + ", ".join(measured) + "; defaults: the rest") if measured else "defaults"
        return hw


def _sparse_down_rate(rng, weight_bytes: int, density: float, n_threads: int) -> float:
    """Bytes/s of the sparse FFN's down projection: `density` of the 8-bit (Q8_0) neuron-major rows of 4096
    values in `weight_bytes`, each times its activation, summed (what a decode step's down reads)."""
    q8 = type_info("q8_0")
    dim = 4096
    block = quantize(rng.standard_normal((256, dim)).astype(np.float32) * 0.05, "q8_0")
    n = max(256, weight_bytes // block.shape[1] // 256 * 256)
    rows = np.ascontiguousarray(np.tile(block, (n // 256, 1)))  # values repeat; the traffic does not
    n_idx = max(1, int(n * density))
    coef = rng.standard_normal(n_idx).astype(np.float32)
    best = 1e30
    for _ in range(5):  # other rows each time, as for the row-sparse products
        idx = np.sort(rng.choice(n, n_idx, replace=False)).astype(np.int32)
        best = min(best, _timed(lambda: _core.axpy_rows(rows, q8.id, n, dim, idx, coef, n_threads=n_threads)))
    return n_idx * block.shape[1] / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
